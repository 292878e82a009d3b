"""Issue 28: every setting has one declaration, ampd/config.py's.

- ``WorkerConfig`` and ``SimConfig`` hold settings; each of their fields with a default takes it
  from ampd.config (``config.inherit``), and ``simulate()``'s keywords take theirs from SimConfig.
- Every flag of `ampd up`, `ampd simulate` and of each service (and the sidecar's tool processes)
  is an ampd.config setting, put on its parser by ``config.add_flags``.
- No parser in ampd/, services/ or benchmarks/ declares a setting's flag by hand (``add_argument``):
  benchmarks reuse the declaration and may change its default (``set_defaults``) for their runs.
- The stats window and the reorder window have one home each, imported everywhere else.

The source rules are read with ``ast`` (nothing is run). ``ROOT`` may be pointed at a copy of the
tree (the helpers take it as an argument) to see a rule fail.
"""
from __future__ import annotations

import argparse
import ast
import importlib
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from ampd import config

ROOT = Path(__file__).resolve().parents[2]

# Fields of the derived configs that are not a setting's value (no default of a setting is written).
NOT_SETTINGS = {
    "WorkerConfig": {"kind", "port"},  # the worker's kind, the port it bound
    # the loaded profile; the prefill groups resolved by ampd.deployment.worker_shape (no 'auto');
    # the router's keywords and the path latencies, parsed from their settings by ampd.sim.cli
    "SimConfig": {"profile", "prefill", "router_options", "path"},
}
# Flags spelled like a setting that mean something else, each with why (allowed add_argument calls).
OTHER_MEANING = {
    ("ampd/launcher.py", "--seed"): "ampd demo: the seed of the demo trace, not the router's",
    ("ampd/launcher.py", "--json"): "ampd demo: a report file only (no '-')",
    ("ampd/workload/cli.py", "--seed"): "ampd trace generate: the trace's seed",
    ("ampd/planner/cli.py", "--ttft-slo"): "ampd plan: default derived from the profile (docs/planner.md)",
    ("ampd/planner/cli.py", "--itl-slo"): "ampd plan: default derived from the profile (docs/planner.md)",
    ("ampd/profiler/cli.py", "--engine"): "ampd profile: the engine to time, mock/torch/sglang, no default",
    ("ampd/profiler/cli.py", "--profile"): "ampd profile: the profile timing --engine mock, no default",
    ("ampd/profiler/cli.py", "--tp"): "ampd profile: a list of TP degrees",
    ("ampd/profiler/cli.py", "--name"): "ampd profile: the new profile's name",
    ("ampd/bench/cli.py", "--model"): "ampd bench --api openai: the model asked for (default: the front's first)",
    ("benchmarks/live_policies.py", "--seed"): "the trace's seed (--router-seed is the router's)",
    ("benchmarks/live_policies.py", "--prefill"): "a worker count (the SPEC is built with --tp)",
    ("benchmarks/live_policies.py", "--decode"): "a worker count (the SPEC is built with --tp)",
    ("benchmarks/multihost_kv.py", "--host"): "the hidden address of the benchmark's own child process",
    ("ampd/bench/cli.py", "--json"): "ampd bench: a report file only (no '-')",
    ("ampd/workload/cli.py", "--json"): "ampd trace stats: a switch, print the statistics as JSON",
    ("benchmarks/fencing.py", "--json"): "the benchmark's results file",
    ("benchmarks/kv_evict.py", "--json"): "the benchmark's results file",
    ("benchmarks/kv_overlap_compare.py", "--json"): "the benchmark's results file",
    ("benchmarks/sim_fingerprint.py", "--json"): "the benchmark's fingerprints file",
}
# Parameters named after the windows and the SLOs: their defaults come from the one home, never a literal.
WINDOW_AND_SLO_PARAMS = {"window_s": "stats_window", "stats_window": "stats_window", "window": "reorder_window",
                         "reorder_window": "reorder_window", "ttft_slo_s": "ttft_slo", "ttft_slo": "ttft_slo",
                         "itl_slo_s": "itl_slo", "itl_slo": "itl_slo"}
# One home each: (module, name); ampd.config's default is it.
HOMES = {"stats_window": ("ampd.window", "STATS_WINDOW_S"), "reorder_window": ("ampd.policy.reorder", "REORDER_WINDOW")}


def _sources(root: Path, *dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py") if "/v1/" not in p.as_posix())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def derived_defaults_written_here(root: Path) -> list[str]:
    """WorkerConfig/SimConfig fields with a default not taken from ampd.config (read off the source)."""
    out = []
    for path, cls in (("ampd/runtime.py", "WorkerConfig"), ("ampd/sim/config.py", "SimConfig")):
        body = _class(ast.parse((root / path).read_text()), cls).body
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)) or node.value is None:
                continue
            name = node.target.id
            if name in NOT_SETTINGS[cls]:
                continue
            v = node.value
            inherited = (isinstance(v, ast.Call) and isinstance(v.func, (ast.Name, ast.Attribute))
                         and (getattr(v.func, "id", None) or getattr(v.func, "attr", None)) == "inherit")
            if not inherited:
                out.append(f"{path}:{node.lineno} {cls}.{name} = {ast.unparse(v)} (declare it with inherit(SETTING))")
    return out


def simulate_defaults_written_here(root: Path) -> list[str]:
    """simulate()'s keywords that hold a SimConfig setting field, with a default other than SimConfig's."""
    from ampd.sim.config import SimConfig

    held = {f.name for f in fields(SimConfig) if "setting" in f.metadata}
    tree = ast.parse((root / "ampd/sim/loop.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "simulate")
    out = []
    for arg, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
        if arg.arg in held and d is not None and ast.unparse(d) != f"SimConfig.{arg.arg}":
            out.append(f"ampd/sim/loop.py:{fn.lineno} simulate({arg.arg}={ast.unparse(d)}): use SimConfig.{arg.arg}")
    return out


def hand_declared_flags(root: Path) -> list[str]:
    """add_argument calls outside ampd/config.py that declare a setting's flag."""
    flags = {config.flag_name(n) for n in config.SETTINGS}
    out = []
    for path in _sources(root, "ampd", "services", "benchmarks"):
        rel = path.relative_to(root).as_posix()
        if rel == "ampd/config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                continue
            for a in node.args:
                if isinstance(a, ast.Constant) and a.value in flags and (rel, a.value) not in OTHER_MEANING:
                    out.append(f"{rel}:{node.lineno} add_argument({a.value!r}): use ampd.config.add_flags")
    return out


def literal_window_and_slo_defaults(root: Path) -> list[str]:
    """Function parameters named after a window or an SLO whose default is a number written there."""
    out = []
    for path in _sources(root, "ampd", "services"):
        rel = path.relative_to(root).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = fn.args
            pos = [*a.posonlyargs, *a.args]
            pairs = [*zip(pos[len(pos) - len(a.defaults):], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
            for arg, d in pairs:
                if arg.arg in WINDOW_AND_SLO_PARAMS and isinstance(d, ast.Constant) and d.value is not None:
                    out.append(f"{rel}:{fn.lineno} {fn.name}({arg.arg}={d.value!r}): the default of "
                               f"{WINDOW_AND_SLO_PARAMS[arg.arg]} has its home elsewhere")
    return out


def test_worker_and_simulator_configs_take_every_default_from_ampd_config():
    from ampd.runtime import WorkerConfig
    from ampd.sim.config import SimConfig

    assert derived_defaults_written_here(ROOT) == []
    assert simulate_defaults_written_here(ROOT) == []
    for cls in (WorkerConfig, SimConfig):
        for f in fields(cls):
            required = f.default is MISSING and f.default_factory is MISSING
            if f.name in NOT_SETTINGS[cls.__name__] or (required and "setting" not in f.metadata):
                continue  # not a setting, or one the caller must give (no default written)
            name = f.metadata.get("setting")
            assert name in config.SETTINGS, f"{cls.__name__}.{f.name} names no setting"
            default = f.default if f.default is not MISSING else f.default_factory()
            assert default == config.default_of(name), f"{cls.__name__}.{f.name}"
    # every setting they hold comes in on their parser: the decode worker's, `ampd simulate`'s
    for cls, names in ((WorkerConfig, config.SERVICE_SETTINGS["decode"]), (SimConfig, config.SIMULATE_SETTINGS)):
        held = {f.metadata["setting"] for f in fields(cls) if "setting" in f.metadata}
        assert held <= set(names), f"{cls.__name__}: {sorted(held - set(names))} on no parser"
    # the drift issue 28 found: one TTFT SLO and one model default
    assert SimConfig.ttft_slo_s == WorkerConfig.ttft_slo_s == config.PolicyConfig.ttft_slo
    assert WorkerConfig.model == config.DeploymentConfig.model


def test_one_config_from_args():
    import ampd.runtime

    assert not hasattr(ampd.runtime, "config_from_args")
    hits = [p.relative_to(ROOT).as_posix() for p in _sources(ROOT, "ampd", "services")
            if "def config_from_args" in p.read_text()]
    assert hits == ["ampd/config.py"]


def _options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """option string -> dest, every subparser's included."""
    out = {}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        for o in a.option_strings:
            out[o] = a.dest
    return out


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    from ampd.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {f"ampd {c}": sub.choices[c] for c in ("up", "simulate")}
    for svc in ("coordinator", "prefill", "decode", "sidecar", "planner", "frontend"):
        out[svc] = importlib.import_module(f"services.{svc}.server").build_parser()
    out["sidecar tool process"] = importlib.import_module("services.sidecar.toolproc").build_parser()
    return out


def flags_without_a_setting(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    out = []
    for who, parser in parsers.items():
        for opt, dest in _options(parser).items():
            if opt in ("-h", "--help"):
                continue
            if dest not in config.SETTINGS or opt not in (config.flag_name(dest), "--no-" + dest.replace("_", "-")):
                out.append(f"{who}: {opt} has no ampd.config setting")
    return out


def test_every_flag_of_up_simulate_and_the_services_is_a_setting():
    parsers = _command_parsers()
    assert flags_without_a_setting(parsers) == []
    # and the rule bites: a hand-made flag is found
    extra = argparse.ArgumentParser()
    extra.add_argument("--queue-depth", type=int, default=3)
    assert flags_without_a_setting({"x": extra}) == ["x: --queue-depth has no ampd.config setting"]


def test_no_parser_declares_a_settings_flag_by_hand():
    assert hand_declared_flags(ROOT) == []


def test_the_windows_have_one_home():
    assert literal_window_and_slo_defaults(ROOT) == []
    for name, (module, const) in HOMES.items():
        assert config.default_of(name) == getattr(importlib.import_module(module), const)
        # ampd/config.py names the home instead of writing the number
        src = (ROOT / "ampd/config.py").read_text()
        decl = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.AnnAssign)
                    and isinstance(n.target, ast.Name) and n.target.id == name)
        assert ast.unparse(decl.value.args[0]) == const


@pytest.mark.parametrize("path,old,new,rule", [
    ("ampd/sim/config.py", 'ttft_slo_s: float = inherit("ttft_slo")', "ttft_slo_s: float = 1.0",
     derived_defaults_written_here),
    ("ampd/runtime.py", 'model: str = inherit("model")', 'model: str = ""', derived_defaults_written_here),
    ("ampd/sim/loop.py", "window_s: float = SimConfig.window_s", "window_s: float = 10.0",
     simulate_defaults_written_here),
    ("ampd/window.py", "window_s: float = STATS_WINDOW_S", "window_s: float = 10.0",
     literal_window_and_slo_defaults),
    ("ampd/sim/cli.py", "add_flags(p, SIMULATE_SETTINGS",
     'p.add_argument("--stats-window", type=float, default=10.0)\n    add_flags(p, SIMULATE_SETTINGS',
     hand_declared_flags),
])
def test_the_rules_fail_on_a_second_default(tmp_path, path, old, new, rule):
    """Each source rule finds a default written twice in a copy of the tree."""
    copy = tmp_path / "tree"
    for d in ("ampd", "services", "benchmarks"):
        for p in _sources(ROOT, d):
            target = copy / p.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(p.read_text())
    assert rule(copy) == []
    f = copy / path
    text = f.read_text()
    assert old in text, old
    f.write_text(text.replace(old, new, 1))
    assert rule(copy), f"{rule.__name__} missed {new!r} in {path}"
