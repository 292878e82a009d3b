"""ampd/config.py: one home per setting; flags and environment variables derived from it."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from ampd import config
from ampd.cli import build_parser
from ampd.deployment import SpecError, check_names, parse_spec, worker_shape


def _parser(names, **kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    config.add_flags(p, names, **kw)
    return p


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_every_setting_has_one_name_help_and_a_default():
    seen = set()
    for cls in config.GROUPS:
        for f in fields(cls):
            assert f.name not in seen
            seen.add(f.name)
            assert f.metadata["help"], f"{cls.__name__}.{f.name} has no help text"
    assert set(config.SETTINGS) == seen
    assert config.flag_name("reorder_window") == "--reorder-window"
    assert config.env_name("reorder_window") == "AMPD_REORDER_WINDOW"


def test_defaults_live_here_once():
    c = config.Config()
    assert c.deployment.profile == config.DEFAULT_PROFILE
    assert (c.policy.alpha, c.policy.beta) == (config.ALPHA, config.BETA) == (0.9, 0.85)
    assert (c.policy.kv_overlap, c.policy.kv_admission, c.policy.reorder_window) == (True, "wait", 3)


def test_flags_parse_back_to_the_config():
    p = _parser(config.UP_SETTINGS)
    args = p.parse_args(["--no-kv-overlap", "--kv-admission", "fail", "--reorder-window", "5", "--tool", "a=m:f",
                         "--tool", "b=m:g", "--policy", "ampd-window", "--stats-window", "4"])
    cfg = config.config_from_args(args)
    assert (cfg.policy.kv_overlap, cfg.policy.kv_admission, cfg.policy.reorder_window) == (False, "fail", 5)
    assert cfg.deployment.tool == ("a=m:f", "b=m:g") and cfg.worker.stats_window == 4.0
    assert cfg.get("policy") == "ampd-window"
    # to_argv is the inverse: the same flags parse to the same settings
    again = config.config_from_args(p.parse_args(config.to_argv(cfg, config.UP_SETTINGS)))
    assert again == cfg


def test_a_repeatable_flag_replaces_its_default():
    """script_tools defaults to ("replay",): argparse's "append" would only ever add to it."""
    p = _parser(("script_tools",))
    assert p.parse_args([]).script_tools == ["replay"]
    assert p.parse_args(["--script-tools", "calculator"]).script_tools == ["calculator"]
    assert p.parse_args(["--script-tools", "replay", "--script-tools", "calc"]).script_tools == ["replay", "calc"]
    assert p.parse_args([]).script_tools == ["replay"]  # the default itself is left as it was
    env = {"AMPD_SCRIPT_TOOLS": "replay, calculator"}
    assert _parser(("script_tools",), env=True, environ=env).parse_args([]).script_tools == ["replay", "calculator"]


def test_bad_values_name_the_flag():
    p = _parser(("reorder_window", "ttft_slo", "kv_admission"))
    for argv, msg in ((["--reorder-window", "0"], "must be >= 1"), (["--ttft-slo", "-1"], "must be > 0"),
                      (["--ttft-slo", "nan"], "finite"), (["--reorder-window", "x"], "an integer")):
        with pytest.raises(argparse.ArgumentError, match=msg) as e:
            p.parse_args(argv)
        assert argv[0] in str(e.value)
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        p.parse_args(["--kv-admission", "drop"])
    with pytest.raises(config.ConfigError, match="--reorder-window: must be >= 1"):
        config.Config.of(reorder_window=0).validate()
    with pytest.raises(TypeError, match="unknown setting 'queue_window'"):
        config.Config.of(queue_window=3)


def test_environment_replaces_defaults_only_where_asked():
    env = {"AMPD_POLICY": "remote", "AMPD_KV_OVERLAP": "off", "AMPD_TP": "", "AMPD_TOOL": "a=m:f, b=m:g"}
    args = _parser(config.SERVICE_SETTINGS["decode"] + ("tool",), env=True, environ=env).parse_args([])
    assert (args.policy, args.kv_overlap, args.tp, args.tool) == ("remote", False, 1, ["a=m:f", "b=m:g"])
    assert _parser(("policy",), environ=env).parse_args([]).policy == "ampd"  # env=False ignores it
    assert _parser(("policy",), env=True, environ=env).parse_args(["--policy", "local"]).policy == "local"
    with pytest.raises(config.ConfigError, match=r"AMPD_KV_OVERLAP \(--kv-overlap\): expected true or false"):
        _parser(("kv_overlap",), env=True, environ={"AMPD_KV_OVERLAP": "maybe"})


def test_up_simulate_and_services_share_flag_names():
    sub = {a.dest: a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)}["command"]
    up, sim = _options(sub.choices["up"]), _options(sub.choices["simulate"])
    for name in ("reorder_window", "kv_overlap", "kv_admission", "slack", "stats_window", "chunked_prefill"):
        assert config.flag_name(name) in up and config.flag_name(name) in sim, name
    assert "--no-kv-overlap" in up and "--no-kv-overlap" in sim
    assert "--queue-window" not in sim and "--window" not in up and "--window" not in sim
    for kind in ("prefill", "decode"):
        opts = _options(_parser(config.SERVICE_SETTINGS[kind]))
        assert {"--kv-overlap", "--no-kv-overlap", "--kv-admission", "--reorder-window"} <= opts
    for text in (sub.choices["up"].description, sub.choices["simulate"].description):
        assert "co-located workers" in text


def test_check_names_lists_the_registry():
    check_names({"policy": "ampd-window", "profile": "zero@none"})
    with pytest.raises(config.ConfigError, match=r"--policy \(AMPD_POLICY\): unknown policy 'x'; valid policies: ampd"):
        check_names({"policy": "x"})
    with pytest.raises(config.ConfigError, match=r"--profile \(AMPD_PROFILE\): unknown profile"):
        check_names({"profile": "no-such@thing"})


# ------------------------------------------------------------------------ deployment shapes
def test_spec_counts_and_groups():
    assert parse_spec("3") == ((1, 3),) and parse_spec("none") == () and parse_spec("0") == ()
    assert parse_spec("tp4*1,tp2*2") == ((4, 1), (2, 2))
    with pytest.raises(SpecError, match="tpN\\*R"):
        parse_spec("tp2x2")


def test_one_colocated_rule():
    s = worker_shape("colocated", "tp2*2", "tp4*1")
    assert (s.prefill, s.decode, s.colocated) == ((), ((4, 1), (2, 2)), True)
    assert worker_shape("continuum", "tp4*1", "tp4*1").decode == ((4, 2),)  # same GPU count, merged
    s = worker_shape("ampd", "tp2*2", "tp4*1")
    assert (s.prefill, s.decode, s.colocated) == (((2, 2),), ((4, 1),), False)
    with pytest.raises(SpecError, match="--decode: the deployment needs at least one decode worker"):
        worker_shape("ampd", "tp1*1", "none")
    with pytest.raises(SpecError, match="--prefill: TP 3 is not in the profile"):
        worker_shape("ampd", "tp3*1", "tp1*1", tps=(1, 2))
    with pytest.raises(ValueError, match="unknown policy"):
        worker_shape("nope", "1", "1")


def test_launcher_and_simulator_use_the_one_rule(tmp_path):
    from ampd.launcher import Deployment, Options

    dep = Deployment(Options(prefill="tp2*1", decode="tp2*1", policy="colocated", redis_url="redis://x",
                             run_dir=str(tmp_path)))
    assert (dep.prefill_tps, dep.decode_tps) == ([], [2, 2])
    assert "co-located" in dep.describe()


def test_prefix_sharing_is_on_by_default_and_an_engine_with_its_own_kv_shares_in_its_cache():
    from ampd.runtime import worker_config
    from services.decode.server import build_parser

    base = ["--worker-id", "d", "--redis-url", "redis://127.0.0.1:1"]
    assert config.PolicyConfig().prefix_sharing
    assert worker_config(build_parser().parse_args(base), "decode", 1).prefix_sharing
    assert worker_config(build_parser().parse_args(base + ["--prefix-sharing"]), "decode", 1).prefix_sharing
    assert not worker_config(build_parser().parse_args(base + ["--no-prefix-sharing"]), "decode", 1).prefix_sharing
    # sglang keeps its KV itself and shares prefixes in its radix cache: no index over the pool, no error
    assert not worker_config(build_parser().parse_args(base + ["--engine", "sglang"]), "decode", 1).prefix_sharing
    assert config.pool_prefix_sharing(True, kv_in_pool=True)
    assert not config.pool_prefix_sharing(True, kv_in_pool=False)
    assert not config.pool_prefix_sharing(False, kv_in_pool=True)


def test_the_decode_worker_takes_prefix_sharing_with_the_host_tier_and_eviction():
    from ampd.runtime import worker_config
    from services.decode.server import build_parser

    args = build_parser().parse_args(["--worker-id", "d", "--redis-url", "redis://127.0.0.1:1", "--prefix-sharing",
                                      "--kv-host-mb", "4", "--kv-evict"])
    cfg = worker_config(args, "decode", 1)
    assert (cfg.prefix_sharing, cfg.kv_host_mb, cfg.kv_evict) == (True, 4.0, True)
