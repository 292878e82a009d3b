"""`ampd profile`: the mock round trip (profiling the mock recovers the profile that times it), a real
torch engine (a tiny random Llama) profiled on a tiny grid with its JSON round-tripped, and the CLI's
refusal, which leaves an existing profile file as it was.

Real parts: the engines' own prefill and decode on a real KV pool, KV READs through two NIXL agents
paced as a prefill worker paces them. Small grids keep it short; the mock's 10 passes let one clean
run per point survive a busy machine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ampd.perf import load_profile, profile_from_dict
from ampd.profiler import Grid, merge_runs, profile_engine

pytestmark = pytest.mark.timeout(180)

# llama3.1-70b at TP 2: its costs are 6 ms and more, so the harness's own jitter on a shared 2-core
# box (a fraction of a millisecond) stays far below the 5 % the round trip allows. The smallest KV read
# is 512 tokens: at 256 the fixed cost of a NIXL transfer (post, notification poll) came to 5.15 %.
GRID = Grid(l_incr=(1, 8, 64, 256), l_hist=(0, 2048), batch=(1, 4, 16, 64), context=(512, 4096),
            kv_tokens=(512, 2048, 8192), reps=10)


def test_mock_round_trip_within_5_percent_at_every_grid_point():
    src = load_profile("llama3.1-70b@h20")
    run = profile_engine("mock", profile=src.name, tps=(2,), grid=GRID)
    got = profile_from_dict(json.loads(json.dumps(run.document)), "profiled")  # the file as written parses
    worst = {}
    for lh, li, _ in run.samples["tp.2.t_pre"]:
        worst.setdefault("t_pre", []).append(abs(got.t_pre(2, lh, li) / src.t_pre(2, lh, li) - 1))
    for b, ctx, _ in run.samples["tp.2.t_dec"]:
        worst.setdefault("t_dec", []).append(abs(got.t_dec(2, b, ctx) / src.t_dec(2, b, ctx) - 1))
    for s, d, n, _ in run.samples["t_kv"]:
        worst.setdefault("t_kv", []).append(abs(got.t_kv(n, s, d) / src.t_kv(n, s, d) - 1))
    assert len(worst["t_pre"]) == 8 and len(worst["t_kv"]) == 3
    assert len(worst["t_dec"]) == 7  # 64 x 4096 context tokens exceed a TP 2 replica's KV: not measured
    for fn, errs in worst.items():
        assert max(errs) <= 0.05, (fn, [round(e, 4) for e in errs])
    # the error is measured on held-out points only (one l_hist between the two, l_incr between each pair)
    he = run.document["profiling"]["held_out_error"]
    assert set(he) == {"tp.2.t_pre", "tp.2.t_dec", "t_kv"} and "fit_error" not in run.document["profiling"]
    assert he["tp.2.t_pre"]["points"] == 3 and he["t_kv"]["points"] == 2
    assert run.problems == [], run.problems
    assert got.kv_capacity_tokens(2) == src.kv_capacity_tokens(2)
    assert got.kv_bytes_per_token == src.kv_bytes_per_token


def test_unknown_engine_and_missing_profile_are_named():
    with pytest.raises(ValueError, match=r"^engine: 'vllm' cannot be profiled \(available: mock, torch, sglang\)"):
        profile_engine("vllm")
    with pytest.raises(ValueError, match=r"^model: model '/nonexistent' is neither"):
        profile_engine("torch", model="/nonexistent")
    with pytest.raises(ValueError, match=r"^grid: 'huge' is not one of tiny, small, full"):
        profile_engine("torch", grid="huge")
    with pytest.raises(ValueError, match=r"^profile: the mock engine is timed by a profile"):
        profile_engine("mock")
    with pytest.raises(ValueError, match=r"^tp: \[1\] not in profile llama3.1-70b@h20"):
        profile_engine("mock", profile="llama3.1-70b@h20", tps=(1,))


TINY = Grid(l_incr=(1, 4, 16, 64), l_hist=(0, 64), batch=(1, 2, 4), context=(16, 64), kv_tokens=(16, 64, 256), reps=1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from ampd.engine.torch_models import save_tiny_llama

    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=512, layers=2, hidden_size=64))


def test_a_real_torch_engine_profiles_and_its_profile_round_trips(tiny_llama, tmp_path, capsys):
    run = profile_engine("torch", model=tiny_llama, grid=TINY, kv_pool_mb=4)
    doc = json.loads(json.dumps(run.document))
    got = profile_from_dict(doc, "profiled")
    assert got.to_json() == run.profile.to_json()
    # 2 layers x 2 KV heads x 16 head dims x K and V x fp32: the engine's, not a profile's
    assert got.kv_bytes_per_token == 2 * 2 * 16 * 2 * 4 and got.tps == (1,)
    assert got.kv_capacity_tokens(1) == 4 * 2**20 // got.kv_bytes_per_token
    prof = doc["profiling"]
    assert prof["engine"] == "torch" and prof["samples_are"].startswith("min over 1 runs (2 for t_kv)")
    assert prof["compute_threads"] == torch.get_num_threads()  # recorded as given, never changed
    # a computing engine is fitted continuous and non-decreasing: no piece of it can be refused for shape
    for fn in (got.tp_models[1].pre, got.tp_models[1].dec, got.kv_transfer.bytes_per_link):
        assert all(b >= 0 for b in fn.beta) and all(abs(j) < 1e-9 for j in fn.discontinuities())
    # decode is timed as a round's steady state: the step after a round's first, at context + 1
    assert {(b, x) for b, x, _ in run.samples["tp.1.t_dec"]} == {(b, b * (c + 1)) for c in (16, 64) for b in (1, 2, 4)}
    assert set(prof["held_out_error"]) == {"tp.1.t_pre", "tp.1.t_dec", "t_kv"}
    for q, err in prof["held_out_error"].items():
        fitted = {tuple(s[:-1]) for s in prof["samples"][q]}
        held = {tuple(s[:-1]) for s in prof["held_out_samples"][q]}
        assert err["points"] == len(held) > 0 and not fitted & held, q
        assert all(s[-1] > 0 for s in prof["samples"][q] + prof["held_out_samples"][q]), q
    assert {(lh, li) for lh, li, _ in run.samples["tp.1.t_pre"]} == {(lh, li) for lh in (0, 64) for li in (1, 4, 16, 64)}
    assert got.t_pre(1, 64, 64) > 0 and got.t_dec(1, 4, 256) > 0 and got.t_kv(256, 1, 1) > 0
    # two runs merged: each point's mean, refitted and checked again
    merged = merge_runs([run, run])
    assert merged.samples == {q: [tuple(x) for x in v] for q, v in run.samples.items()}
    assert merged.profile.to_json() == run.profile.to_json() and merged.problems == run.problems
    assert len(merged.document["profiling"]["merged_from"]) == 2
    # `ampd profile --report FILE`: the saved file's held-out errors, recomputed from its own samples
    from ampd.profiler.cli import report

    saved = tmp_path / "p.json"
    saved.write_text(json.dumps(run.document))
    assert report(str(saved)) == 0
    out = capsys.readouterr().out
    for q, e in run.held_out.items():
        assert f"{q:<12} {e.max_rel:>13.1%} {e.mean_rel:>8.1%} {e.points:>7}" in out, out


def _profile_cli(*flags):
    return subprocess.run([sys.executable, "-m", "ampd", "profile", *flags], capture_output=True, text=True,
                          timeout=150)


def test_a_refused_profile_never_replaces_an_existing_file(tiny_llama, tmp_path):
    out = tmp_path / "p.json"
    out.write_text("the profile that was here\n")
    # no measured engine comes within a millionth on held-out points: refused, whatever the machine's load
    r = _profile_cli("--engine", "torch", "--model", tiny_llama, "--grid", "tiny", "--reps", "1", "--kv-pool-mb", "4",
                     "--max-held-out-error", "1e-6", "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert "refused: tp.1.t_pre: held-out error" in r.stderr and "l_hist=64, l_incr=" in r.stderr
    assert "ampd profile: error: profile refused" in r.stderr and "left as it was" in r.stderr
    assert "Traceback" not in r.stderr
    assert out.read_text() == "the profile that was here\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize("flags, message", [
    (("--engine", "torch", "--model", "/nonexistent"), "--model: model '/nonexistent' is neither"),
    (("--engine", "vllm"), "--engine: 'vllm' cannot be profiled"),
    (("--engine", "torch", "--profile", "qwen3-32b@h20"), "--profile: only the mock engine is timed by a profile"),
    (("--engine", "mock"), "--profile: the mock engine is timed by a profile"),
    (("--engine", "torch", "--reps", "0"), "--reps: must be >= 1"),
    (("--engine", "torch", "--tp", "x"), "--tp: expected comma-separated integers"),
])
def test_bad_input_is_one_line_without_a_traceback(tmp_path, flags, message):
    r = _profile_cli(*flags, "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "p.json").exists()
