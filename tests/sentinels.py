"""A real Redis master, one replica and three Sentinels on loopback (or any address), for the tests
of `--redis-url redis+sentinel://...` (tests/integration/test_sentinel.py, tests/multihost).

Sentinels here decide fast (down after 1 s, quorum 2) so that a failover fits a short test; a
production set keeps Redis's defaults or tunes them (docs/deploy.md "Redis with Sentinel").
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from ampd.state.local import free_port, stop_process

MASTER = "ampd-main"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


class SentinelSet:
    """``with SentinelSet(tmp) as s``: s.url (redis+sentinel://...), s.master_port(), s.kill_master()."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1", sentinels: int = 3,
                 wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        self.dir = Path(workdir)
        self.host = host
        self.wrap = wrap or (lambda argv: argv)
        self.n_sentinels = sentinels
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    # -------------------------------------------------------------------------------- start
    def __enter__(self) -> "SentinelSet":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "ab")
        try:
            self.procs[name] = subprocess.Popen(self.wrap(argv), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("redis-a", "redis-b"):
            self.ports[name] = port = free_port()
            d = self.dir / name
            d.mkdir(exist_ok=True)
            argv = [exe, "--port", str(port), "--bind", self.host, "--save", "", "--appendonly", "no",
                    "--dir", str(d), "--protected-mode", "no"]
            if name == "redis-b":
                argv += ["--replicaof", self.host, str(self.ports["redis-a"])]
            self._spawn(name, argv)
        self._wait(lambda: self._client("redis-b").info("replication").get("master_link_status") == "up",
                   "the replica to sync with the master")
        for i in range(self.n_sentinels):
            name = f"sentinel-{i}"
            self.ports[name] = port = free_port()
            conf = self.dir / f"{name}.conf"  # a Sentinel rewrites its own config file: one each
            conf.write_text(
                f"port {port}\nbind {self.host}\nprotected-mode no\ndir {self.dir}\n"
                f"sentinel monitor {MASTER} {self.host} {self.ports['redis-a']} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER} 1\n")
            self._spawn(name, [exe, str(conf), "--sentinel"])
        # every Sentinel knows the replica and its peers: a failover can be agreed on
        self._wait(lambda: all(self._sentinel_ready(i) for i in range(self.n_sentinels)),
                   "the Sentinels to find the replica and each other", timeout_s=30)

    def _sentinel_ready(self, i: int) -> bool:
        d = self._client(f"sentinel-{i}").sentinel_master(MASTER)
        return int(d["num-slaves"]) >= 1 and int(d["num-other-sentinels"]) >= self.n_sentinels - 1

    def _client(self, name: str) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.ports[name], socket_timeout=2, socket_connect_timeout=2)

    def _wait(self, pred: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if pred():
                    return
            except (redis.RedisError, OSError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what} (logs in {self.dir})")
            time.sleep(0.1)

    # ------------------------------------------------------------------------------ use
    @property
    def url(self) -> str:
        hosts = ",".join(f"{self.host}:{self.ports[f'sentinel-{i}']}" for i in range(self.n_sentinels))
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def master(self) -> tuple[str, int]:
        """(host, port) of the master as the first Sentinel that answers says."""
        for i in range(self.n_sentinels):
            try:
                host, port = self._client(f"sentinel-{i}").sentinel_get_master_addr_by_name(MASTER)
                return (host.decode() if isinstance(host, bytes) else host), int(port)
            except (redis.RedisError, OSError):
                continue
        raise RuntimeError("no Sentinel answered")

    def master_name(self) -> str:
        port = self.master()[1]
        return next(n for n, p in self.ports.items() if p == port and n.startswith("redis-"))

    def client(self, name: str | None = None) -> redis.Redis:
        """A plain client of ``name`` (default: the current master)."""
        return self._client(name or self.master_name())

    def kill_master(self) -> str:
        """SIGKILL to the current master; returns its name."""
        name = self.master_name()
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        return name

    def wait_failover(self, old: str, timeout_s: float = 30.0) -> str:
        """Until the Sentinels name a master other than ``old`` and it accepts writes; its name."""
        new: list[str] = []

        def promoted() -> bool:
            name = self.master_name()
            if name == old:
                return False
            self._client(name).set("ampd-sentinel-probe", b"1", px=1000)
            new.append(name)
            return True
        self._wait(promoted, "the Sentinels to promote the replica", timeout_s)
        return new[-1]

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                stop_process(proc, grace_s=3.0)
            except OSError:
                pass
        self.procs.clear()
