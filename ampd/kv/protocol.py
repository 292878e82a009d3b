"""KVTransport: what the workers need of a KV transport, whatever moves the bytes.

Two implementations:

- ``ampd.kv.transport.NixlTransport``: NIXL (UCX) between processes and hosts. The services, the
  profiler and the benchmarks use it; it is the one that ships.
- ``ampd.kv.loopback.LoopbackTransport``: byte copies between pools of one process, checked like
  NIXL checks them. For unit tests and single-process use only: it cannot reach another process.

A segment is anything with ``block``, ``offset`` and ``tokens`` (``ampd.kv.Segment``, or a task's
repeated Segment field as it came). A transport subclasses ``KVTransport`` explicitly, and so takes
the calls written here on top of its own ``poll_notifs`` and ``close``.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol, Sequence

from .finetimer import fine_sleep
from .notifs import NotifListener
from .pool import KVPool, PoolLayout, Segment

__all__ = ["KVTransferError", "KVTransport"]


class KVTransferError(Exception):
    """A KV transfer could not be made: unknown peer, NIXL refusal, error state or timeout."""


class KVTransport(Protocol):
    """READ/WRITE of KV segments between this transport's pool and its peers' pools, and
    notifications between them. All calls come from one thread (the event loop's)."""

    name: str  # this agent's name: peers know it by it
    pool: KVPool  # the pool it moves bytes in and out of (registered with it for its whole life)
    bytes_read: int
    bytes_written: int
    transfers: int  # transfers done (not counting empty ones)
    notifs_sent: int  # notifications sent on their own (send_notif)

    # --- identity -------------------------------------------------------------------------------
    @property
    def layout(self) -> PoolLayout:
        return self.pool.layout

    def metadata(self) -> bytes:
        """What a peer needs to reach this transport (published in Redis by the workers)."""
        ...

    # --- peers ----------------------------------------------------------------------------------
    def add_peer(self, name: str, metadata: bytes, layout: PoolLayout, *, warm_s: float = 2.0) -> None:
        """Loads a peer's metadata (idempotent; new metadata replaces the old). KVTransferError when
        the metadata is not usable or names another agent. A transport with a connection to set up
        warms it, in the background inside a running loop (``warm_peer`` awaits it)."""
        ...

    async def warm_peer(self, name: str) -> None:
        """Waits for the background warm-up add_peer started (no-op when there is none)."""
        ...

    def has_peer(self, name: str) -> bool:
        ...

    def peer_layout(self, name: str) -> PoolLayout:
        ...

    def peers(self) -> list[str]:
        ...

    def remove_peer(self, name: str) -> None:
        """Forgets a peer (no-op for an unknown one)."""
        ...

    # --- transfers ------------------------------------------------------------------------------
    async def read(self, peer: str, remote: Sequence[Segment], local: Sequence[Segment], *,
                   timeout_s: float | None = None) -> int:
        """READs the peer's `remote` segments into our `local` segments; bytes moved. ValueError when
        the two cover different token counts or one lies outside its layout; KVTransferError when
        the transfer cannot be made (unknown peer, closed transport, refusal, timeout)."""
        ...

    async def write(self, peer: str, local: Sequence[Segment], remote: Sequence[Segment], notif: bytes = b"", *,
                    timeout_s: float | None = None) -> int:
        """WRITEs our `local` segments into the peer's `remote` segments; `notif` (if any) reaches
        the peer after the data has landed. Bytes moved. Zero tokens with a notif sends the notif."""
        ...

    # --- notifications --------------------------------------------------------------------------
    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (peer name, message). Never blocks; empty
        once closed."""
        ...

    async def send_notif(self, peer: str, notif: bytes) -> None:
        """A notification not bound to a transfer."""
        ...

    def listen(self, callback: Callable[[str, bytes], None], pending: Callable[[], bool]) -> NotifListener:
        """Starts a NotifListener that calls ``callback(peer, msg)`` on the running event loop for
        every notification; it polls only while ``pending()`` is true (see NotifListener). Its
        owner stops it (``await listener.stop()``)."""
        if self.closed:
            raise KVTransferError(f"transport {self.name!r} is closed")
        return NotifListener(self, callback, pending)

    async def watch_notifs(self, callback: Callable[[str, bytes], Awaitable[None] | None], *,
                           interval_s: float = 200e-6) -> None:
        """Polls forever (until cancelled or closed), calling `callback(peer, notif)` per notification."""
        while not self.closed:
            for peer, msg in self.poll_notifs():
                r = callback(peer, msg)
                if asyncio.iscoroutine(r):
                    await r
            await fine_sleep(interval_s)

    # --- lifetime -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        ...

    def close(self) -> None:
        """Forgets all peers and releases the pool. Idempotent. Work this transport started in the
        background is cancelled; ``aclose`` also waits for it to end."""
        ...

    async def aclose(self) -> None:
        """close(), after cancelling and awaiting what this transport runs in the background."""
        self.close()

    def counters(self) -> dict[str, int]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "transfers": self.transfers,
                "notifs_sent": self.notifs_sent}

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
