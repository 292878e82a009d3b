"""A private redis-server on a free loopback port: how `ampd up`, `ampd bench-sched` and the tests
get their shared state when no Redis URL is given. The one place Redis start-up is written."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["RedisStartError", "free_port", "redis_command", "start_redis", "stop_process"]


class RedisStartError(RuntimeError):
    """redis-server is missing or did not come up; the message says which and where its log is."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_command(port: int, workdir: Path) -> list[str]:
    """A memory-only redis-server on loopback (no snapshots, no append-only file)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisStartError("redis-server not found: install it (apt-get install redis-server) or pass --redis-url")
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]


def start_redis(workdir: Path, *, log: Path | None = None, timeout_s: float = 15.0,
                wrap: Callable[[list[str]], list[str]] | None = None, port: int = 0,
                new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """Starts a private redis-server (on ``port``, or a free one) and waits until it answers PING.
    Returns (process, URL).

    Its output goes to ``log`` (discarded when None). On failure the process is stopped and
    RedisStartError raised."""
    import redis

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        command = redis_command(port, workdir)
        proc = subprocess.Popen(wrap(command) if wrap else command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=new_session)
    finally:
        if log is not None:
            out.close()
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url)
    try:
        while True:
            try:
                client.ping()
                return proc, url
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    stop_process(proc)
                    raise RedisStartError(f"redis-server did not start (log: {log})") from None
                time.sleep(0.05)
    finally:
        client.close()


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
