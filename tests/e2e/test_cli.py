"""The launcher and the CLI as a user runs them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

AMPD = [sys.executable, "-m", "ampd"]
ENV = dict(os.environ, NIXL_LOG_LEVEL="WARN")


def run(*args, timeout=120):
    return subprocess.run([*AMPD, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def _descendants(pid: int) -> set[int]:
    """Every live process whose ancestry reaches pid (read from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = set(), {pid}
    while frontier:
        kids = {p for p, pp in parent.items() if pp in frontier}
        out |= kids
        frontier = kids
    return out


def test_trace_gen_then_bench_names_a_malformed_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    r = run("trace", "gen", "--preset", "toolbench", "--rate", "1", "--duration", "5", "--seed", "3",
            "--out", str(trace))
    assert r.returncode == 0, r.stderr
    lines = trace.read_text().splitlines()
    lines.insert(1, '{"id": "x", "arrival": 1.0, "rounds": [{"input": 10, "output": -3}]}')
    trace.write_text("\n".join(lines) + "\n")
    r = run("bench", "--target", "127.0.0.1:1", "--trace", str(trace), "--ttft-slo", "1", "--itl-slo", "0.1")
    assert r.returncode == 2
    assert "line 2" in r.stderr and "rounds[0].output" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_against_nothing_is_a_clear_error(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "arrival": 0, "rounds": [{"input": 10, "output": 3}]}\n')
    r = run("bench", "--target", "127.0.0.1:1", "--trace", str(trace), "--ttft-slo", "1", "--itl-slo", "0.1")
    assert r.returncode == 2 and "cannot reach the coordinator" in r.stderr
    assert "Traceback" not in r.stderr


def test_up_with_bad_arguments_is_a_clear_error():
    r = run("up", "--prefill", "tp3*1")
    assert r.returncode == 2 and "TP 3" in r.stderr and "Traceback" not in r.stderr
    r = run("up", "--policy", "nope")
    assert r.returncode == 2 and "nope" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.timeout(180)
def test_up_serves_then_sigterm_leaves_no_orphan(tmp_path, redis_url):
    proc = subprocess.Popen([*AMPD, "up", "--prefill", "1", "--decode", "1", "--profile", "zero@none",
                             "--redis-url", redis_url, "--namespace", "e2e-up", "--run-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        assert line.startswith("coordinator "), proc.stderr.read() if proc.poll() is not None else line
        address = line.split()[1]
        line = proc.stdout.readline()
        assert line.startswith("frontend http://127.0.0.1:") and line.split()[1].endswith("/v1"), line
        front = line.split()[1]
        kids = _descendants(proc.pid)
        assert len(kids) >= 5  # coordinator, prefill, decode, sidecar, frontend
        trace = tmp_path / "t.jsonl"
        trace.write_text('{"id": "a", "arrival": 0, "rounds": [{"input": 100, "output": 5, "tool_s": 0.1},'
                         ' {"input": 20, "output": 4}]}\n')
        r = run("bench", "--target", address, "--trace", str(trace), "--ttft-slo", "1", "--itl-slo", "0.1",
                "--verify-tokens", "--json", str(tmp_path / "r.json"))
        assert r.returncode == 0, r.stderr
        import json

        report = json.loads((tmp_path / "r.json").read_text())
        assert report["completed"] == 1 and report["token_mismatches"] == 0
        # the same trace through the OpenAI-compatible front, the history resent each round
        r = run("bench", "--api", "openai", "--target", front, "--trace", str(trace), "--ttft-slo", "1",
                "--itl-slo", "0.1", "--json", str(tmp_path / "o.json"))
        assert r.returncode == 0, r.stderr
        report = json.loads((tmp_path / "o.json").read_text())
        assert report["completed"] == 1 and report["api"] == "openai"
        # round 2 continues round 1's session (100 + 5 - 1 tokens); with --prefix-sharing (the default)
        # round 1 found too the full blocks of its prompt that the gRPC run above left cached on the
        # decode worker (a replayed prompt's ids are its session's: ampd.workload.ids.round_ids), all but
        # the block of its last token; the front reports both in cached_tokens
        from ampd.launcher import Options

        cfg = Options()  # (ampd up's settings: the defaults)
        bt = cfg.worker.block_tokens
        shared = (100 - 1) // bt * bt if cfg.policy.prefix_sharing else 0
        assert report["cached_prompt_tokens"] == shared + 100 + 5 - 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{k}").exists() and "zombie" not in _state(k) for k in kids):
            assert time.monotonic() < deadline, "children outlived the launcher"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


def _state(pid: int) -> str:
    try:
        return "zombie" if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z") else "live"
    except OSError:
        return "zombie"


def _sim(trace, *args):
    return run("simulate", "--trace", str(trace), "--profile", "llama3.1-70b@h20", "--ttft-slo", "5",
               "--itl-slo", "0.1", *args)


def test_simulate_colocated_needs_no_prefill_and_disaggregated_one_clear_error(tmp_path):
    """Issue 26: `--prefill` is optional under a co-located policy (none), and a policy that sends
    prefills to prefill workers gets one line when it has none."""
    import json

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "arrival": 0, "rounds": [{"input": 100, "output": 5, "tool_s": 0.5}, '
                     '{"input": 20, "output": 4}]}\n')
    out = tmp_path / "r.json"
    r = _sim(trace, "--policy", "colocated", "--decode", "tp8*4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["deployment"]["prefill"] == "none" and rep["deployment"]["decode"] == "tp8*4"
    assert rep["completed"] == 1
    for extra in ((), ("--prefill", "none")):
        r = _sim(trace, "--policy", "ampd", "--decode", "tp8*4", *extra)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.count("\n") == 1 and "--prefill: policy ampd" in r.stderr, r.stderr
    r = run("up", "--policy", "remote", "--prefill", "none", "--decode", "1")
    assert r.returncode == 2 and "--prefill: policy remote" in r.stderr and "Traceback" not in r.stderr


def test_simulate_bad_input_is_one_line_naming_the_field(tmp_path):
    import json

    empty, bad, prof = tmp_path / "e.jsonl", tmp_path / "b.jsonl", tmp_path / "p.json"
    empty.write_text("")
    bad.write_text('{"id": "a", "arrival": 0, "rounds": [{"input": 0, "output": 3}]}\n')
    from ampd.perf import load_profile

    d = load_profile("llama3.1-70b@h20").to_json()
    d["tp"] = {"8": {k: v for k, v in d["tp"]["8"].items() if k != "t_dec"}}  # TP 8 without its decode fit
    prof.write_text(json.dumps(d))
    for trace, profile, want in ((empty, "llama3.1-70b@h20", "no sessions"),
                                 (bad, "llama3.1-70b@h20", "rounds[0].input"),
                                 (empty, str(prof), "'tp.8.t_dec'")):
        r = run("simulate", "--trace", str(trace), "--profile", profile, "--policy", "colocated",
                "--decode", "tp8*1", "--ttft-slo", "5", "--itl-slo", "0.1")
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1


def test_plan_bad_input_is_one_line_naming_the_field(tmp_path):
    """`ampd plan` as a user runs it: an empty or malformed trace, a profile without a TP degree or
    whose smallest replica exceeds the GPU budget, each one line naming the flag and the value."""
    import json

    good = tmp_path / "t.jsonl"
    good.write_text('{"id": "a", "arrival": 0, "rounds": [{"input": 100, "output": 3}]}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "arrival": 0, "rounds": [{"input": 100, "output": 3}]}\n{"id": "b", "arrival"\n')
    neg = tmp_path / "neg.jsonl"
    neg.write_text('{"id": "a", "arrival": 0, "rounds": [{"input": -5, "output": 3}]}\n')
    from ampd.perf import load_profile

    prof = load_profile("llama3.1-70b@h20").to_json()
    no_tp = tmp_path / "no_tp.json"
    no_tp.write_text(json.dumps(dict(prof, tp={})))
    tp8 = tmp_path / "tp8.json"
    tp8.write_text(json.dumps(dict(prof, tp={k: v for k, v in prof["tp"].items() if k == "8"})))
    cases = [
        ((str(empty), "llama3.1-70b@h20", "8"), "--trace: " + str(empty) + ": the trace has no sessions"),
        ((str(bad), "llama3.1-70b@h20", "8"), "line 2: invalid JSON"),
        ((str(neg), "llama3.1-70b@h20", "8"), "field 'rounds[0].input': must be an integer >= 1, got -5"),
        ((str(good), str(no_tp), "8"), "--profile: " + str(no_tp) + ": field 'tp': expected a non-empty object"),
        ((str(good), str(tp8), "4"), "--gpus: 4 GPUs cannot hold one replica of llama3.1-70b@h20: the smallest "
                                     "replica that holds the model needs 8 GPUs"),
        ((str(good), "llama3.1-70b@h20", "0"), "--gpus: must be an integer >= 1, got 0"),
    ]
    for (trace, profile, gpus), want in cases:
        r = run("plan", "--trace", trace, "--profile", profile, "--gpus", gpus)
        assert r.returncode == 2, (want, r.stdout, r.stderr)
        lines = [x for x in r.stderr.splitlines() if x.startswith("ampd plan: error:")]
        assert len(lines) == 1 and want in lines[0], (want, r.stderr)
        assert "Traceback" not in r.stderr


# What a cold `ampd plan` may not import: the engines' and the services' stacks. Its path is the CLI,
# the planner, the simulator and pyscipopt (which brings numpy); docs/planner.md "Cold planning time".
HEAVY = ("torch", "transformers", "sglang", "scipy", "pandas", "sklearn", "grpc", "redis", "nixl", "aiohttp",
         "fastapi", "uvicorn", "httpx", "google.protobuf", "safetensors", "tokenizers", "sentencepiece")


def test_cold_plan_imports_nothing_heavy(tmp_path):
    """A fresh `ampd plan` process (as a user runs it) plans with SCIP and imports none of HEAVY:
    its import log (python -X importtime) names every module the process loaded."""
    import json

    from ampd.workload import dump_trace, generate

    trace = tmp_path / "t.jsonl"
    dump_trace(generate("toolbench", 0.8, 60.0, 3)[:40], trace)
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "ampd", "plan", "--profile", "llama3.1-70b@h20",
                        "--trace", str(trace), "--gpus", "8", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "ampd.planner.ilp" in loaded and "pyscipopt" in loaded
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert not heavy, heavy
    doc = json.loads(out.read_text())
    assert doc["solver"] == "scip" and doc["solver_calls"] == len(doc["solves"]) >= 1
