"""Two hosts on one machine: network namespaces joined by a veth pair, each with its own address
(`make test-multihost`; needs root and iproute2). ``with Hosts() as h``: ``h.addr[i]``,
``h.wrap(i, argv)`` runs ``argv`` on host ``i``; on exit every process left in the namespaces is
killed and the namespaces (with their veth ends) deleted, also when the test failed.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time

SUBNET = "10.213.0"  # private, and only inside the namespaces: nothing outside them routes it


class HostsError(RuntimeError):
    """The namespaces or their link could not be made; the message says which command and why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostsError(f"`ip {' '.join(args)}` failed: {exc}") from None
    if check and out.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {out.stderr.strip() or out.returncode}")
    return out


class Hosts:
    def __init__(self, n: int = 2) -> None:
        if n != 2:
            raise ValueError("one veth pair joins two hosts")
        tag = f"{os.getpid() % 100000}"  # concurrent runs get their own namespaces and links
        self.names = [f"ampd{tag}h{i + 1}" for i in range(n)]
        self.links = [f"ampd{tag}v{i + 1}" for i in range(n)]  # <= 15 characters, the kernel's limit
        self.addr = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.made: list[str] = []  # the namespaces this made: close deletes these only
        self.linked = False

    def __enter__(self) -> "Hosts":
        if shutil.which("ip") is None:
            raise HostsError("`ip` (iproute2) is not installed: apt-get install iproute2")
        if os.geteuid() != 0:
            raise HostsError("network namespaces need root (run `make test-multihost` as root)")
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            self.linked = True
            atexit.register(self.close)  # also when the test run itself is interrupted
            for ns, link, addr in zip(self.names, self.links, self.addr):
                _ip("link", "set", link, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
            self._wait_link()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_link(self, timeout_s: float = 10.0) -> None:
        """Until both ends of the veth pair are up (a moment after `link set up`)."""
        deadline = time.monotonic() + timeout_s
        while not all(" state UP " in _ip("-n", ns, "-o", "link", "show", link).stdout
                      for ns, link in zip(self.names, self.links)):
            if time.monotonic() > deadline:
                raise HostsError(f"the link {self.links[0]}-{self.links[1]} is not up after {timeout_s:g} s")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.close()

    def wrap(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``host`` (0-based)."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def close(self) -> None:
        """Kills what still runs in the namespaces (bounded), then deletes them (and the veth pair)."""
        if not self.made and not self.linked:
            return
        existing = set(_ip("netns", "list", check=False).stdout.split())
        for ns in self.made:
            if ns not in existing:
                continue
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + 5
                while pids and time.monotonic() < deadline:
                    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
                    time.sleep(0.1)
                if not pids:
                    break
            _ip("netns", "del", ns, check=False)
        self.made.clear()
        if self.linked:  # gone with its namespaces, unless it never moved into one
            _ip("link", "del", self.links[0], check=False)
            self.linked = False
