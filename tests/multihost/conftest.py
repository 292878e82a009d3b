"""`timeout 900 make test-multihost` (.ci/run) ends a stuck run with SIGTERM: turned into
KeyboardInterrupt here, it unwinds the tests' `with` blocks and fixtures, so their processes stop and
their namespaces are deleted (tests/multihost/hosts.py also deletes them at exit)."""
from __future__ import annotations

import signal


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt)
