"""`ampd plan` as a user runs it: the JSON of docs/report.md, errors naming the flag."""
from __future__ import annotations

import json

from ampd.cli import main
from ampd.workload import dump_trace, generate


def test_plan_json_keys(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    dump_trace(generate("toolbench", 1.0, 60.0, 4)[:20], trace)
    out = tmp_path / "plan.json"
    args = ["plan", "--profile", "qwen3-32b@h20", "--trace", str(trace), "--gpus", "4", "--top", "2",
            "--candidates", "3", "--ttft-slo", "1.5", "--itl-slo", "0.05", "--json", str(out),
            "--estimates-cache", str(tmp_path / "est.json")]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["solver"] == "scip" and doc["solver_calls"] == len(doc["solves"]) >= 3  # one per finalist at least
    for s in doc["solves"]:
        assert set(s) == {"family", "status", "seconds", "nodes"} and s["status"] in ("optimal", "infeasible")
    t = doc["timings"]
    assert set(t) >= {"estimates_s", "solve_s", "simulations_s", "simulations"}
    assert t["simulations"] == doc["candidates_checked"] and t["cached_simulations"] == 0
    assert main(args) == 0
    again = json.loads(out.read_text())
    assert again["timings"]["simulations"] == 0 and again["timings"]["cached_simulations"] > 0  # the same trace
    assert [(e["prefill"], e["decode"]) for e in again["top"]] == [(e["prefill"], e["decode"]) for e in doc["top"]]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["gpus"] == 4 and doc["seconds"] > 0 and len(doc["top"]) == 2
    for t in doc["top"]:
        assert set(t) >= {"prefill", "decode", "p95_s", "slo_attainment"}
    printed = capsys.readouterr()
    assert "plan for 4 GPUs" in printed.out and doc["top"][0]["decode"] in printed.out


def test_plan_errors_name_the_flag(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    dump_trace(generate("toolbench", 1.0, 10.0, 4)[:3], trace)
    assert main(["plan", "--profile", "llama3.1-70b@h20", "--trace", str(trace), "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "ampd plan: error: --gpus: 1 GPUs cannot hold one replica of llama3.1-70b@h20" in err
    assert "Traceback" not in err
    assert main(["plan", "--profile", "llama3.1-70b@h20", "--trace", str(tmp_path / "none.jsonl"),
                 "--gpus", "8"]) == 2
    assert "--trace:" in capsys.readouterr().err
    assert main(["plan", "--profile", "llama3.1-70b@h20", "--trace", str(trace), "--gpus", "8",
                 "--itl-slo", "0"]) == 2
    assert "--itl-slo: must be a number > 0" in capsys.readouterr().err
    assert main(["plan", "--profile", "llama3.1-70b@h20", "--trace", str(trace), "--gpus", "8",
                 "--check-sessions", "-1"]) == 2
    assert "--check-sessions: must be an integer >= 0 (0: the whole trace), got -1" in capsys.readouterr().err


def test_an_unreachable_slo_is_said_in_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    dump_trace(generate("toolbench", 1.0, 10.0, 4)[:5], trace)
    assert main(["plan", "--profile", "llama3.1-70b@h20", "--trace", str(trace), "--gpus", "8",
                 "--ttft-slo", "0.001", "--itl-slo", "0.0001"]) == 0
    assert "note: no session meets the SLO on any deployment checked (--ttft-slo 0.001 s" in capsys.readouterr().out
