"""Log entries never render a frame's local variables (prompts, tool arguments live there): issue 24,
finding 1, where rich's traceback rendered a 1,000-deep request's locals for minutes."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
from ampd import logs
log = logs.configure("t")
def f(prompt="MARKER-PAYLOAD-7f3a", nested=None):
    raise ValueError("boom")
try:
    f(nested=[[[[1]]]])
except Exception:
    log.exception("request failed")
"""


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_exception_log_has_no_locals(fmt):
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                         env={"AMPD_LOG_FORMAT": fmt, "PATH": ""}, cwd=".")
    assert "request failed" in out.stderr and "ValueError" in out.stderr  # the traceback is there
    assert "MARKER-PAYLOAD" not in out.stderr
