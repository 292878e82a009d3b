"""NixlTransport: one NIXL agent (UCX backend) with a KVPool's buffer registered; the KVTransport
(ampd.kv.protocol) the services use.

All calls on one transport must come from one thread (the event loop's): the agent is created
without NIXL's listener thread, so NIXL does no locking of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# NIXL logs INFO to stdout unless told otherwise; "WARNING" is rejected, "WARN" works.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

from .finetimer import fine_sleep  # noqa: E402
from .notifs import NotifListener  # noqa: E402
from .pool import KVPool, PoolLayout, Segment  # noqa: E402
from .protocol import KVTransferError, KVTransport  # noqa: E402
from .ranges import pair_ranges  # noqa: E402

__all__ = ["KVTransferError", "NixlTransport", "NotifListener", "bind_ucx_to", "interface_of"]

log = logging.getLogger(__name__)

# Completion polls of a transfer: a yield, then every XFER_POLL_MIN_S; once the transfer has taken
# longer, every 1/XFER_POLL_RATIO of its time so far, at most every XFER_POLL_MAX_S (fine_sleep:
# under uvloop an asyncio.sleep below 0.5 ms does not sleep, and one above waits ~1.1 ms). A KV
# transfer of a round here is done ~50-100 us after transfer() returns (when it is not done in it):
# the old 50 us doubling saw one of 300 us at 350 or 750 us. A poll costs ~30 us of CPU (a loop
# wake-up, measured), so a 100 ms transfer polls ~115 times (~3.5 % of a core) and is seen at most
# 1/XFER_POLL_RATIO late.
XFER_POLL_MIN_S = 50e-6
XFER_POLL_RATIO = 20
XFER_POLL_MAX_S = 2e-3
_WARM_BYTES = 64


# Microseconds NIXL's progress thread sleeps between passes. nixl 1.5.1's Python wrapper hard-codes
# 0, a busy loop: two idle workers took both cores of a 2-core box (measured). At 200 us an idle
# agent uses ~2.5 % of a core and a transfer waits at most ~0.2 ms more for progress.
PROGRESS_DELAY_US = 200
_agent_lock = threading.Lock()


def _make_agent(name: str, backends: list[str]) -> nixl_agent:
    """A NIXL agent whose progress thread sleeps PROGRESS_DELAY_US between passes.

    The wrapper exposes no setting for it, so for the duration of the constructor the binding's
    config class is swapped for a subclass that keeps the delay at least PROGRESS_DELAY_US.
    """
    import nixl._api as api

    real = api.nixlBind
    prop = real.nixlAgentConfig.pthrDelay

    class _Config(real.nixlAgentConfig):
        pthrDelay = property(lambda self: prop.__get__(self),
                             lambda self, v: prop.__set__(self, max(int(v), PROGRESS_DELAY_US)))

    class _Binding:
        nixlAgentConfig = _Config

        def __getattr__(self, attr):
            return getattr(real, attr)

    with _agent_lock:
        api.nixlBind = _Binding()
        try:
            return nixl_agent(name, nixl_agent_config(backends=backends))
        finally:
            api.nixlBind = real


def interface_of(host: str) -> str:
    """The network interface that holds IPv4 address ``host`` ("" when none does, or for a wildcard)."""
    import fcntl
    import ipaddress
    import socket
    import struct

    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:  # a name: the address it resolves to
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return ""
    if addr.is_unspecified:
        return ""
    if addr.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == str(addr):
                return name
    return ""


def bind_ucx_to(host: str) -> None:
    """Makes the UCX listener of every NIXL agent this process creates bind only the interface of
    ``host`` (the process's configured address; 127.0.0.1: loopback only). Left alone when the
    operator set UCX_NET_DEVICES, or when ``host`` is a wildcard. Call before the first agent."""
    dev = interface_of(host)
    if dev:
        os.environ.setdefault("UCX_NET_DEVICES", dev)


def _xfer_poll_delay(waited_s: float) -> float:
    """The sleep before the next completion poll of a transfer that has run ``waited_s``."""
    return min(XFER_POLL_MAX_S, max(XFER_POLL_MIN_S, waited_s / XFER_POLL_RATIO))


@dataclass
class _Peer:
    name: str
    metadata: bytes
    layout: PoolLayout
    warm_task: asyncio.Task | None = None


class NixlTransport(KVTransport):
    """READ/WRITE of KV segments between this process's pool and peers' pools over NIXL. A segment
    here is anything with ``block``, ``offset`` and ``tokens``: a task's repeated Segment field goes
    in as it came (building ``ampd.kv.Segment``s of it costs more than the transfer's walk over it).

    Its background tasks are the peers' warm-up reads (add_peer): it keeps them (``_warming``),
    and ``aclose`` cancels and awaits them before the pool is deregistered."""

    def __init__(
        self,
        agent_name: str,
        pool: KVPool,
        *,
        backends: Sequence[str] = ("UCX",),
        timeout_s: float = 30.0,
    ):
        self.name = agent_name
        self.pool = pool
        self.timeout_s = float(timeout_s)
        self.bytes_read = 0
        self.bytes_written = 0
        self.transfers = 0
        self.notifs_sent = 0
        self._peers: dict[str, _Peer] = {}
        self._warming: set[asyncio.Task] = set()  # warm-up reads running, a removed peer's included
        self._closed = False
        self._agent = _make_agent(agent_name, list(backends))
        if not self._agent.backends:
            raise KVTransferError(f"NIXL agent {agent_name!r}: no backend of {list(backends)} loaded")
        lay = pool.layout
        self._reg = self._agent.register_memory([(lay.base_addr, lay.nbytes, 0, "")], "DRAM")
        # Private landing zone for the warm-up read in add_peer (never touches the pool).
        self._scratch = np.zeros(_WARM_BYTES, dtype=np.uint8)
        self._scratch_reg = self._agent.register_memory(
            [(int(self._scratch.ctypes.data), _WARM_BYTES, 0, "")], "DRAM"
        )
        # Metadata is taken after registration: a peer holding older metadata cannot reach the pool.
        self._metadata = self._agent.get_agent_metadata()

    # --- identity -------------------------------------------------------------------------------
    @property
    def layout(self) -> PoolLayout:
        return self.pool.layout

    def metadata(self) -> bytes:
        return self._metadata

    @property
    def agent(self) -> nixl_agent:
        """The underlying NIXL agent (for diagnostics)."""
        return self._agent

    # --- peers ----------------------------------------------------------------------------------
    def add_peer(
        self, name: str, metadata: bytes, layout: PoolLayout, *, warm_s: float = 2.0
    ) -> None:
        """Load a peer's metadata and warm the connection. Idempotent; new metadata replaces old.

        Warming = `make_connection` plus one 64-byte READ of the peer's pool into a private scratch
        buffer (never the pool). Called inside a running event loop, the read runs as a background
        task (await `warm_peer(name)` to wait for it); outside one, add_peer waits for it, at most
        `warm_s` seconds. `warm_s=0` skips it. Without it the first real transfer to the peer pays
        the UCX connection setup (15-150 ms on a loaded 2-core box). A failed warm-up only logs.
        """
        self._check_open()
        if isinstance(layout, dict):
            layout = PoolLayout.from_dict(layout)
        cur = self._peers.get(name)
        if cur is not None and cur.metadata == metadata:
            cur.layout = layout
            return
        if cur is not None:
            self._forget(name)
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise KVTransferError(f"add_peer {name!r}: NIXL rejected metadata: {e!r}") from e
        loaded_name = loaded.decode() if isinstance(loaded, (bytes, bytearray)) else str(loaded)
        if loaded_name != name:
            self._agent.remove_remote_agent(loaded_name)
            raise KVTransferError(f"add_peer {name!r}: metadata belongs to agent {loaded_name!r}")
        peer = _Peer(name, bytes(metadata), layout)
        self._peers[name] = peer
        try:
            self._agent.make_connection(name)
        except Exception as e:  # not fatal: the first transfer connects on its own
            log.warning("make_connection to %s failed: %r", name, e)
        if warm_s <= 0 or layout.nbytes < _WARM_BYTES:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._warm_blocking(peer, warm_s)
        else:
            peer.warm_task = task = asyncio.create_task(self._warm_async(peer, warm_s), name=f"nixl-warm-{name}")
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)

    async def warm_peer(self, name: str) -> None:
        """Wait for the background warm-up started by add_peer (no-op when there is none)."""
        p = self._peer(name, "warm_peer")
        if p.warm_task is not None:
            await asyncio.shield(p.warm_task)

    def _warm_start(self, peer: _Peer):
        agent = self._agent
        ld = agent.get_xfer_descs(
            np.array([[self._scratch.ctypes.data, _WARM_BYTES, 0]], dtype=np.uint64), "DRAM"
        )
        rd = agent.get_xfer_descs(
            np.array([[peer.layout.base_addr, _WARM_BYTES, 0]], dtype=np.uint64), "DRAM"
        )
        handle = agent.initialize_xfer("READ", ld, rd, peer.name, b"")
        return handle, agent.transfer(handle)

    def _warm_end(self, peer: _Peer, handle, state: str, warm_s: float) -> None:
        if state not in ("DONE", "CANCELLED"):
            log.warning("warm-up read from %s: state %s after %.3g s", peer.name, state, warm_s)
        if handle is not None:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as e:
                log.warning("release of warm-up handle (%s): %r", peer.name, e)

    def _warm_blocking(self, peer: _Peer, warm_s: float) -> None:
        handle, state = None, "ERR"
        try:
            handle, state = self._warm_start(peer)
            deadline = time.monotonic() + warm_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(20e-6)
                state = self._agent.check_xfer_state(handle)
        except Exception as e:  # not fatal: real transfers report their own errors
            log.warning("warm-up read from %s failed: %r", peer.name, e)
            state = "FAILED"
        self._warm_end(peer, handle, state, warm_s)

    async def _warm_async(self, peer: _Peer, warm_s: float) -> None:
        handle, state = None, "ERR"
        try:
            handle, state = self._warm_start(peer)
            deadline = time.monotonic() + warm_s
            started = time.monotonic()
            delay = 0.0
            while state == "PROC" and time.monotonic() < deadline and not self._closed:
                await fine_sleep(delay)
                state = self._agent.check_xfer_state(handle)
                delay = _xfer_poll_delay(time.monotonic() - started)
        except asyncio.CancelledError:
            state = "CANCELLED"
            raise
        except Exception as e:
            log.warning("warm-up read from %s failed: %r", peer.name, e)
            state = "FAILED"
        finally:
            self._warm_end(peer, handle, state, warm_s)
            peer.warm_task = None

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def peer_layout(self, name: str) -> PoolLayout:
        return self._peer(name, "peer_layout").layout

    def peers(self) -> list[str]:
        return list(self._peers)

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._forget(name)

    def _forget(self, name: str) -> None:
        p = self._peers.pop(name)
        if p.warm_task is not None:
            p.warm_task.cancel()
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            log.warning("remove_remote_agent %s: %r", name, e)

    def _peer(self, name: str, op: str) -> _Peer:
        self._check_open()
        p = self._peers.get(name)
        if p is None:
            raise KVTransferError(f"{op} with unknown peer {name!r} (known: {sorted(self._peers)})")
        return p

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport {self.name!r} is closed")

    # --- transfers ------------------------------------------------------------------------------
    async def read(
        self, peer: str, remote: Sequence[Segment], local: Sequence[Segment], *, timeout_s: float | None = None
    ) -> int:
        """READ the peer's `remote` segments into our `local` segments; bytes moved."""
        n = await self._xfer("READ", peer, local, remote, b"", timeout_s)
        self.bytes_read += n
        return n

    async def write(
        self,
        peer: str,
        local: Sequence[Segment],
        remote: Sequence[Segment],
        notif: bytes = b"",
        *,
        timeout_s: float | None = None,
    ) -> int:
        """WRITE our `local` segments into the peer's `remote` segments; `notif` (if any) reaches
        the peer after the data has landed. Bytes moved. Zero tokens with a notif sends the notif."""
        if isinstance(notif, str):
            notif = notif.encode()
        n = await self._xfer("WRITE", peer, local, remote, bytes(notif), timeout_s)
        if n == 0 and notif:
            await self.send_notif(peer, notif)
        self.bytes_written += n
        return n

    async def _xfer(
        self,
        op: str,
        peer: str,
        local: Sequence[Segment],
        remote: Sequence[Segment],
        notif: bytes,
        timeout_s: float | None,
    ) -> int:
        p = self._peer(peer, op)
        lrows, rrows = pair_ranges(self.pool.layout, local, p.layout, remote)
        if len(lrows) == 0:
            return 0
        nbytes = int(lrows[:, 1].sum())
        agent = self._agent
        try:
            ldescs = agent.get_xfer_descs(lrows, "DRAM")
            rdescs = agent.get_xfer_descs(rrows, "DRAM")
            handle = agent.initialize_xfer(op, ldescs, rdescs, peer, notif)
        except Exception as e:
            raise KVTransferError(f"{op} with peer {peer!r}: NIXL could not prepare: {e!r}") from e
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            state = agent.transfer(handle)
            delay = 0.0
            started = time.monotonic()
            deadline = started + timeout
            while state == "PROC":
                await fine_sleep(delay)
                state = agent.check_xfer_state(handle)
                if state != "PROC":
                    break
                if time.monotonic() > deadline:
                    raise KVTransferError(
                        f"{op} with peer {peer!r}: timed out after {timeout:.3g} s ({nbytes} bytes)"
                    )
                delay = _xfer_poll_delay(time.monotonic() - started)
            if state != "DONE":
                raise KVTransferError(f"{op} with peer {peer!r}: transfer state {state} ({nbytes} bytes)")
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"{op} with peer {peer!r}: {e!r}") from e
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception as e:  # an in-flight handle NIXL could not cancel
                log.warning("release_xfer_handle (%s %s): %r", op, peer, e)
        self.transfers += 1
        return nbytes

    # --- notifications --------------------------------------------------------------------------
    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (peer name, message). Never blocks."""
        if self._closed:
            return []
        got = self._agent.get_new_notifs()
        return [(name, msg) for name, msgs in got.items() for msg in msgs]

    async def send_notif(self, peer: str, notif: bytes) -> None:
        """A notification not bound to a transfer (the peer must hold our metadata too)."""
        self._peer(peer, "send_notif")
        if isinstance(notif, str):
            notif = notif.encode()
        try:
            self._agent.send_notif(peer, bytes(notif))
        except Exception as e:
            raise KVTransferError(f"send_notif to peer {peer!r}: {e!r}") from e
        self.notifs_sent += 1

    # --- lifetime -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """close(), after the warm-up reads still running were cancelled and have ended (each
        releases its NIXL handle before the pool is deregistered)."""
        tasks = list(self._warming)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.close()

    def close(self) -> None:
        """Forget all peers and deregister the pool. Idempotent. Warm-up reads still running are
        cancelled (``aclose`` also awaits them)."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._peers):
            self._forget(name)
        try:
            self._agent.deregister_memory(self._reg)
            self._agent.deregister_memory(self._scratch_reg)
        except Exception as e:
            log.warning("deregister_memory: %r", e)

    def __repr__(self) -> str:
        return f"NixlTransport({self.name!r}, peers={sorted(self._peers)}, closed={self._closed})"
