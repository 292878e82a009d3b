"""The simulator's cores (pyproject.toml [tool.mypy]: ampd/sim, worker, policy, perf, window) type-check
clean: compiling them with mypyc (docs/simulator.md, "Speed") needs it, and a wrong annotation there
would mislead the compiler and the reader alike."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_simulator_cores_type_check_clean(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout
