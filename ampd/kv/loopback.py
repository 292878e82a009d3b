"""LoopbackTransport: a KVTransport between pools of one process, by byte copies.

For unit tests and single-process use: the workers' code that moves KV runs on it with no NIXL
agent, and every byte it moves is really copied from one pool's buffer to another's, at the
addresses ``pair_ranges`` computes from the peer's published layout, as NIXL would move it. It
checks what NIXL refuses: an unknown or closed peer, metadata of another agent, a range outside
the peer's registered pool. It cannot reach another process; the services use
``ampd.kv.transport.NixlTransport``.

Transports find each other through a ``LoopbackHub`` (one per process unless given): a transport's
metadata names its hub entry, as NIXL's metadata names its agent.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Sequence

from .pool import KVPool, PoolLayout, Segment
from .protocol import KVTransferError, KVTransport
from .ranges import pair_ranges

__all__ = ["LoopbackHub", "LoopbackTransport"]

_PREFIX = b"ampd-loopback:"


class LoopbackHub:
    """The open loopback transports of one process (or of one test), by metadata."""

    def __init__(self) -> None:
        self._open: dict[bytes, LoopbackTransport] = {}
        self._ids = itertools.count(1)

    def _join(self, transport: "LoopbackTransport") -> bytes:
        md = _PREFIX + f"{next(self._ids)}:{transport.name}".encode()
        self._open[md] = transport
        return md

    def _leave(self, metadata: bytes) -> None:
        self._open.pop(metadata, None)

    def find(self, metadata: bytes) -> "LoopbackTransport | None":
        return self._open.get(bytes(metadata))


HUB = LoopbackHub()  # the process's, for transports made without one


class LoopbackTransport(KVTransport):
    """KVTransport over this process's memory (module doc)."""

    def __init__(self, agent_name: str, pool: KVPool, *, hub: LoopbackHub | None = None) -> None:
        self.name = agent_name
        self.pool = pool
        self.bytes_read = 0
        self.bytes_written = 0
        self.transfers = 0
        self.notifs_sent = 0
        self._hub = HUB if hub is None else hub
        self._peers: dict[str, tuple[bytes, PoolLayout]] = {}
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._closed = False
        self._metadata = self._hub._join(self)

    # --- identity -------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._metadata

    # --- peers ----------------------------------------------------------------------------------
    def add_peer(self, name: str, metadata: bytes, layout: PoolLayout, *, warm_s: float = 2.0) -> None:
        del warm_s  # no connection to set up
        self._check_open()
        if isinstance(layout, dict):
            layout = PoolLayout.from_dict(layout)
        metadata = bytes(metadata)
        other = self._hub.find(metadata)
        if other is None:
            raise KVTransferError(f"add_peer {name!r}: no open loopback transport has this metadata")
        if other.name != name:
            raise KVTransferError(f"add_peer {name!r}: metadata belongs to agent {other.name!r}")
        self._peers[name] = (metadata, layout)

    async def warm_peer(self, name: str) -> None:
        self._entry(name, "warm_peer")  # nothing to warm: only NIXL's unknown-peer check

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def peer_layout(self, name: str) -> PoolLayout:
        return self._entry(name, "peer_layout")[1]

    def peers(self) -> list[str]:
        return list(self._peers)

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    def _entry(self, name: str, op: str) -> tuple[bytes, PoolLayout]:
        self._check_open()
        got = self._peers.get(name)
        if got is None:
            raise KVTransferError(f"{op} with unknown peer {name!r} (known: {sorted(self._peers)})")
        return got

    def _peer(self, name: str, op: str) -> tuple["LoopbackTransport", PoolLayout]:
        got = self._entry(name, op)
        other = self._hub.find(got[0])
        if other is None:  # it closed: NIXL's transfer to a gone agent fails the same way
            raise KVTransferError(f"{op} with peer {name!r}: the agent is gone")
        return other, got[1]

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport {self.name!r} is closed")

    # --- transfers ------------------------------------------------------------------------------
    async def read(self, peer: str, remote: Sequence[Segment], local: Sequence[Segment], *,
                   timeout_s: float | None = None) -> int:
        n = await self._xfer("READ", peer, local, remote, b"")
        self.bytes_read += n
        return n

    async def write(self, peer: str, local: Sequence[Segment], remote: Sequence[Segment], notif: bytes = b"", *,
                    timeout_s: float | None = None) -> int:
        if isinstance(notif, str):
            notif = notif.encode()
        n = await self._xfer("WRITE", peer, local, remote, bytes(notif))
        if n == 0 and notif:
            await self.send_notif(peer, notif)
        self.bytes_written += n
        return n

    async def _xfer(self, op: str, peer: str, local: Sequence[Segment], remote: Sequence[Segment],
                    notif: bytes) -> int:
        other, layout = self._peer(peer, op)
        lrows, rrows = pair_ranges(self.pool.layout, local, layout, remote)
        if len(lrows) == 0:
            return 0
        mine, theirs = self.pool.buffer, other.pool.buffer
        lbase, rbase = self.pool.layout.base_addr, other.pool.layout.base_addr
        spans = []
        for (la, n, _), (ra, _, _) in zip(lrows.tolist(), rrows.tolist()):
            lo, ro = la - lbase, ra - rbase
            if ro < 0 or ro + n > theirs.nbytes:  # a stale or wrong layout: NIXL refuses unregistered memory
                raise KVTransferError(f"{op} with peer {peer!r}: {n} bytes at {ra:#x} lie outside its registered pool")
            spans.append((lo, ro, n))
        await asyncio.sleep(0)  # a transfer yields to the loop, as NIXL's completion polls do
        for lo, ro, n in spans:
            if op == "READ":
                mine[lo:lo + n] = theirs[ro:ro + n]
            else:
                theirs[ro:ro + n] = mine[lo:lo + n]
        if notif:
            other._inbox.append((self.name, notif))  # after the data has landed
        self.transfers += 1
        return sum(n for _, _, n in spans)

    # --- notifications --------------------------------------------------------------------------
    def poll_notifs(self) -> list[tuple[str, bytes]]:
        if self._closed:
            return []
        out = list(self._inbox)
        self._inbox.clear()
        return out

    async def send_notif(self, peer: str, notif: bytes) -> None:
        other, _ = self._peer(peer, "send_notif")
        if isinstance(notif, str):
            notif = notif.encode()
        other._inbox.append((self.name, bytes(notif)))
        self.notifs_sent += 1

    # --- lifetime -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._peers.clear()
        self._inbox.clear()
        self._hub._leave(self._metadata)

    def __repr__(self) -> str:
        return f"LoopbackTransport({self.name!r}, peers={sorted(self._peers)}, closed={self._closed})"
