"""`ampd plan` as a user runs it: the JSON of DESIGN section 8, errors naming the flag."""
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
    assert doc["estimates"]["simulated"] > 0 and doc["estimates"]["cached"] == 0
    assert main(args[:-4] + ["--gpus", "6", "--json", str(out), "--estimates-cache", str(tmp_path / "est.json")]) == 0
    again = json.loads(out.read_text())
    assert again["estimates"]["simulated"] == 0 and again["estimates"]["cached"] > 0  # another N: all cached
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
