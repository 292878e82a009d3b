"""`ampd trace gen | import-mooncake | stats`."""
from __future__ import annotations

import json

import pytest

from ampd.cli import main
from ampd.workload import load_trace


def test_gen_then_stats(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["trace", "gen", "--preset", "hotpotqa", "--rate", "5", "--duration", "10",
                 "--seed", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    n = len(load_trace(out))
    assert f"wrote {n} sessions to {out}" in text
    assert "mean input tokens / round" in text and "table 1" in text
    assert main(["trace", "stats", str(out), "--json", "--preset", "hotpotqa"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["sessions"] == n and st["mean_rounds"] == 3.0
    assert st["table1"]["mean_input_per_round"] == 1569.8
    assert main(["trace", "stats", str(out)]) == 0
    assert "mean rounds / session" in capsys.readouterr().out


def test_import_mooncake_cli(tmp_path, capsys):
    src = tmp_path / "mc.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "session_id": "x"}\n'
                   '{"timestamp": 1000, "input_length": 20, "output_length": 2, "session_id": "x"}\n')
    out = tmp_path / "t.jsonl"
    assert main(["trace", "import-mooncake", str(src), "--out", str(out)]) == 0
    assert "wrote 1 sessions" in capsys.readouterr().out
    (s,) = load_trace(out)
    assert [(r.input, r.tool_s) for r in s.rounds] == [(10, 1.0), (8, None)]


def test_import_mooncake_cli_keeps_hash_ids(tmp_path, capsys):
    src = tmp_path / "mc.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [46, 47]}\n')
    out = tmp_path / "t.jsonl"
    assert main(["trace", "import-mooncake", str(src), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rounds"][0]["hash_ids"] == [46, 47]
    (s,) = load_trace(out)
    assert s.rounds[0].hash_ids == (46, 47)


@pytest.mark.parametrize("argv, text", [
    (["trace", "gen", "--preset", "nope", "--rate", "1", "--duration", "1", "--out", "X"], "unknown preset 'nope'"),
    (["trace", "gen", "--preset", "gaia", "--rate", "0", "--duration", "1", "--out", "X"], "--rate must be"),
    (["trace", "gen", "--preset", "gaia", "--rate", "1", "--duration", "-1", "--out", "X"], "--duration must be"),
    (["trace", "gen", "--preset", "gaia", "--rate", "1", "--duration", "1", "--seed", "-2", "--out", "X"], "--seed must be"),
    (["trace", "gen", "--preset", "gaia", "--rate", "1", "--duration", "1", "--out", "NODIR/x.jsonl"], "cannot write"),
    (["trace", "stats", "MISSING.jsonl"], "cannot read"),
    (["trace", "stats", "BAD"], "line 1: invalid JSON"),
    (["trace", "import-mooncake", "BAD", "--out", "X"], "line 1: invalid JSON"),
    (["trace", "import-mooncake", "MISSING", "--out", "X"], "cannot read"),
])
def test_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BAD").write_text("{oops\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "X").exists()
