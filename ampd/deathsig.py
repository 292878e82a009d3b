"""``python -m ampd.deathsig PARENT_PID CMD [ARG...]``: exec CMD so that it gets SIGTERM when its parent dies.

The launcher starts every child through this rather than with a ``preexec_fn``. A ``preexec_fn``
makes subprocess fork without exec-ing at once, so gRPC's fork handlers run in the child, and when
the launcher's own process has used gRPC (tests and embedded deployments do) they abort it
(grpcio 1.85: "epoll_wait error: Bad file descriptor", exit status -6). Without a ``preexec_fn``
Python spawns with vfork/posix_spawn, which runs no fork handlers; PR_SET_PDEATHSIG survives execve.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def wrap(argv: list[str]) -> list[str]:
    """``argv`` run so that it dies with this process."""
    return [sys.executable, "-m", "ampd.deathsig", str(os.getpid()), *argv]


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own cleanup still stops its children
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
