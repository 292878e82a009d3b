"""Host-memory KV tier: the accounting of a decode worker's host pool (``--kv-host-mb``).

A session's KV is RESIDENT (device pool), on HOST (host pool only) or GONE (nowhere: its next round
prefills the whole history again); ``KVState`` is the policy's (``ampd.policy.kvtier``). Moves take
time, so each one has a begin and an end (done or failed)::

    RESIDENT --offload_begin--> RESIDENT (moving) --offload_done--> HOST
                                                  --offload_failed--> RESIDENT   (host blocks freed)
    HOST --prefetch_begin--> HOST (moving) --prefetch_done--> RESIDENT           (host blocks freed)
                                           --prefetch_failed--> GONE             (re-prefill)
    RESIDENT | HOST --drop--> GONE --reprefilled--> RESIDENT
    any --release--> (forgotten; host blocks freed)

Pure accounting, no bytes and no I/O: a host copy of ``tokens`` tokens fills host blocks from
position 0, and ``segments`` names them for the KV transport, which moves and checks the bytes.
Every block goes back on ``release``: ``empty`` is True once every session is released.

``HostBlocks`` is here, beside the policy, so that the pure cores (the decode core's tier, the
simulator) can use it; ``ampd.kv.hostpool.HostPool`` is the same accounting whose segments are the
KV transport's ``Segment``s.
"""
from __future__ import annotations

from typing import Final
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from .kvtier import KVState

__all__ = ["KVState", "HostBlocks", "HostPoolTooSmall", "HostPoolTooLarge", "HostKVExhausted", "HostPoolSize",
           "MIB", "AUTO_MEMORY_SHARE", "host_pool_blocks", "check_host_pool", "size_host_pool", "OFFLOADING",
           "PREFETCHING"]

MIB = 1 << 20
OFFLOADING: Final = "offload"
PREFETCHING: Final = "prefetch"


class HostPoolTooSmall(ValueError):
    """The host pool cannot hold one session's KV (refused at start-up)."""


class HostPoolTooLarge(ValueError):
    """An explicit host pool larger than the memory available at start-up (refused at start-up)."""


class HostKVExhausted(Exception):
    """Not enough free host blocks; ``needed`` and ``free`` are block counts."""

    def __init__(self, needed: int, free: int):
        self.needed, self.free = needed, free
        super().__init__(f"host KV pool exhausted: needed {needed} blocks, {free} free")


def host_pool_blocks(host_mb: float, block_tokens: int, bytes_per_token: int) -> int:
    """Whole blocks of ``block_tokens`` x ``bytes_per_token`` bytes in ``host_mb`` MiB (rounded to the
    byte: a size a ratio gave, bytes / MIB, loses no block to the float)."""
    return round(host_mb * MIB) // (block_tokens * bytes_per_token)


def check_host_pool(host_mb: float, block_tokens: int, bytes_per_token: int, session_tokens: int) -> int:
    """The host pool's block count for ``--kv-host-mb`` (0: the tier is off). Raises
    HostPoolTooSmall, naming the sizes, when it cannot hold one session's KV of ``session_tokens``
    tokens (the worker's context limit): such a pool could never take an offload."""
    if host_mb < 0:
        raise HostPoolTooSmall(f"--kv-host-mb must be >= 0 (0: off), got {host_mb:g}")
    if host_mb == 0:
        return 0
    block_bytes = block_tokens * bytes_per_token
    blocks = host_pool_blocks(host_mb, block_tokens, bytes_per_token)
    need = -(-session_tokens // block_tokens)
    if blocks < need:
        need_mb = -(-need * block_bytes // MIB)
        raise HostPoolTooSmall(
            f"--kv-host-mb {host_mb:g}: {blocks} host blocks of {block_tokens} tokens "
            f"({block_bytes} bytes each, {bytes_per_token} bytes a token) hold {blocks * block_tokens} "
            f"tokens, but one session's KV can reach {session_tokens} tokens ({need} blocks, "
            f"{need_mb} MiB); set --kv-host-mb to at least {need_mb}, or --kv-host-ratio 0 and --kv-host-mb 0 to "
            f"turn the host tier off")
    return blocks


# A host pool sized by --kv-host-ratio takes at most this share of the memory available at start-up:
# the pool is pre-touched (docs/kv.md), so a pool larger than the machine would be killed, not swapped.
AUTO_MEMORY_SHARE: Final = 0.5


@dataclass(frozen=True, slots=True)
class HostPoolSize:
    """The host pool a decode worker starts with: ``mb`` MiB (0: the tier is off), ``source``
    ``"explicit"`` (--kv-host-mb), ``"ratio"`` (--kv-host-ratio x the device pool) or ``"off"``, and
    ``note``: why a sized pool was shrunk or turned off (empty when it was not), for the worker's log."""

    mb: float
    source: str
    note: str = ""


def size_host_pool(host_mb: float, ratio: float, device_bytes: int, block_tokens: int, bytes_per_token: int,
                   session_tokens: int, available_bytes: int | None = None) -> HostPoolSize:
    """The host pool of one decode worker whose device KV pool holds ``device_bytes`` bytes.

    ``host_mb`` > 0 is the operator's size: HostPoolTooSmall when it cannot hold one session's KV of
    ``session_tokens`` tokens, HostPoolTooLarge when it exceeds ``available_bytes`` (the memory this
    process may still use; None: not known, as in the simulator). Otherwise the pool is ``ratio`` x the
    device pool (SGLang's --hicache-ratio; 0: off), capped at AUTO_MEMORY_SHARE of ``available_bytes``,
    and it never refuses a start: a pool that the cap leaves too small for one session is off, with
    a ``note`` naming the sizes."""
    if host_mb < 0 or ratio < 0:
        raise HostPoolTooSmall(f"--kv-host-mb and --kv-host-ratio must be >= 0, got {host_mb:g} and {ratio:g}")
    if host_mb > 0:
        check_host_pool(host_mb, block_tokens, bytes_per_token, session_tokens)
        if available_bytes is not None and host_mb * MIB > available_bytes:
            raise HostPoolTooLarge(f"--kv-host-mb {host_mb:g}: the host pool is pre-touched, and this process may "
                                   f"use only {available_bytes / MIB:.0f} MiB more memory; set --kv-host-mb "
                                   f"to at most {available_bytes // MIB}, or 0 to size it by --kv-host-ratio")
        return HostPoolSize(host_mb, "explicit")
    if ratio == 0:
        return HostPoolSize(0.0, "off")
    want = ratio * device_bytes / MIB
    mb, note = want, ""
    if available_bytes is not None and want * MIB > AUTO_MEMORY_SHARE * available_bytes:
        mb = AUTO_MEMORY_SHARE * available_bytes / MIB
        note = (f"host KV pool cut from {want:.1f} MiB (--kv-host-ratio {ratio:g} x the {device_bytes / MIB:.1f} "
                f"MiB device pool) to {mb:.1f} MiB, {AUTO_MEMORY_SHARE:g} of the {available_bytes / MIB:.0f} MiB "
                f"this process may still use")
    need = -(-session_tokens // block_tokens)
    if host_pool_blocks(mb, block_tokens, bytes_per_token) < need:
        need_mb = need * block_tokens * bytes_per_token / MIB
        why = note or (f"--kv-host-ratio {ratio:g} x the {device_bytes / MIB:.1f} MiB device pool is {mb:.1f} MiB")
        return HostPoolSize(0.0, "off", f"{why}; one session's KV can reach {session_tokens} tokens ({need_mb:.1f} "
                                        f"MiB): the host KV tier is off (--kv-host-mb sets its size)")
    return HostPoolSize(mb, "ratio", note)


@dataclass(slots=True)
class _Entry:
    state: KVState = KVState.RESIDENT
    tokens: int = 0  # tokens the host copy holds
    blocks: list[int] = field(default_factory=list)
    moving: str = ""  # OFFLOADING, PREFETCHING or ""


@mypyc_attr(allow_interpreted_subclasses=True)  # ampd.kv.hostpool.HostPool, the live pool, extends it
class HostBlocks:
    """``num_blocks`` host blocks of ``block_tokens`` tokens, and where each session's KV is.
    ``segment(block, offset, tokens)`` makes the segments ``segments`` returns (a tuple here)."""

    def segment(self, block: int, offset: int, tokens: int) -> object:
        return (block, offset, tokens)

    def __init__(self, num_blocks: int, block_tokens: int, bytes_per_token: int = 0):
        if num_blocks < 0 or block_tokens <= 0 or bytes_per_token < 0:
            raise ValueError(f"HostPool: num_blocks and bytes_per_token must be >= 0 and block_tokens > 0, "
                             f"got {num_blocks}, {bytes_per_token}, {block_tokens}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.bytes_per_token = bytes_per_token
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # low ids first
        self._sessions: dict[str, _Entry] = {}
        self.tokens_to_host = 0  # tokens moved, counted when a move checks out
        self.tokens_from_host = 0

    @classmethod
    def from_mb(cls, host_mb: float, block_tokens: int, bytes_per_token: int, session_tokens: int) -> "HostBlocks":
        """A pool of ``--kv-host-mb`` MiB, refused (HostPoolTooSmall) when it cannot hold one
        session's KV of ``session_tokens`` tokens; 0 MiB gives an empty pool (the tier is off)."""
        return cls(check_host_pool(host_mb, block_tokens, bytes_per_token, session_tokens), block_tokens,
                   bytes_per_token)

    # --- reading ------------------------------------------------------------------------------
    @property
    def bytes_to_host(self) -> int:
        return self.tokens_to_host * self.bytes_per_token

    @property
    def bytes_from_host(self) -> int:
        return self.tokens_from_host * self.bytes_per_token

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def empty(self) -> bool:
        """No session tracked and every block free (no leak)."""
        return not self._sessions and len(self._free) == self.num_blocks

    def __len__(self) -> int:
        return len(self._sessions)

    def state(self, session_id: str) -> KVState:
        """The session's KV state; an untracked session is RESIDENT (its KV is on the device)."""
        e = self._sessions.get(session_id)
        return KVState.RESIDENT if e is None else e.state

    def moving(self, session_id: str) -> str:
        e = self._sessions.get(session_id)
        return "" if e is None else e.moving

    def host_blocks(self, session_id: str) -> int:
        e = self._sessions.get(session_id)
        return 0 if e is None else len(e.blocks)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def segments(self, session_id: str) -> list:
        """The host copy's positions [0, tokens) as segments of host blocks (for the transport)."""
        e = self._entry(session_id)
        out, left, bt = [], e.tokens, self.block_tokens
        for b in e.blocks:
            if left <= 0:
                break
            out.append(self.segment(b, 0, min(bt, left)))
            left -= bt
        return out

    # --- moves --------------------------------------------------------------------------------
    def offload_begin(self, session_id: str, tokens: int) -> None:
        """Reserve host blocks for the session's ``tokens`` tokens of KV (all or nothing; raises
        HostKVExhausted); the copy to them starts. A caller that moves bytes writes to
        ``segments(session_id)``; the decode core's tier moves none and builds no segment."""
        if tokens <= 0:
            raise ValueError(f"offload_begin {session_id!r}: tokens must be > 0, got {tokens}")
        e = self._sessions.setdefault(session_id, _Entry())
        self._expect(session_id, e, KVState.RESIDENT, "offload_begin")
        n = self.blocks_for(tokens)
        if n > len(self._free):
            if not e.blocks:
                del self._sessions[session_id]
            raise HostKVExhausted(n, len(self._free))
        e.blocks = self._free[-n:][::-1]
        del self._free[-n:]
        e.tokens = tokens
        e.moving = OFFLOADING

    def offload_done(self, session_id: str) -> None:
        """The copy to the host checked out: the KV is on HOST (the caller frees its device blocks)."""
        e = self._moving(session_id, OFFLOADING, "offload_done")
        e.state, e.moving = KVState.HOST, ""
        self.tokens_to_host += e.tokens

    def offload_failed(self, session_id: str) -> None:
        """The copy failed: the KV stays RESIDENT; the host blocks go back."""
        e = self._moving(session_id, OFFLOADING, "offload_failed")
        e.moving = ""
        self._free_blocks(e)

    def prefetch_begin(self, session_id: str) -> None:
        """The copy back to the device starts (a caller that moves bytes reads ``segments``)."""
        e = self._entry(session_id)
        self._expect(session_id, e, KVState.HOST, "prefetch_begin")
        e.moving = PREFETCHING

    def prefetch_done(self, session_id: str) -> None:
        """The KV is RESIDENT again; the host blocks go back."""
        e = self._moving(session_id, PREFETCHING, "prefetch_done")
        e.state, e.moving = KVState.RESIDENT, ""
        self.tokens_from_host += e.tokens
        self._free_blocks(e)

    def prefetch_failed(self, session_id: str) -> None:
        """A transfer error or a dead peer: the KV is GONE and the session re-prefills its tokens."""
        e = self._moving(session_id, PREFETCHING, "prefetch_failed")
        e.state, e.moving = KVState.GONE, ""
        self._free_blocks(e)

    def drop(self, session_id: str) -> None:
        """Evicted: the KV is GONE (a host copy's blocks go back). Not during a move."""
        e = self._sessions.setdefault(session_id, _Entry())
        if e.moving:
            raise ValueError(f"drop {session_id!r}: its KV is moving ({e.moving})")
        e.state = KVState.GONE
        self._free_blocks(e)

    def reprefilled(self, session_id: str) -> None:
        """A GONE session's history was prefilled again: RESIDENT."""
        e = self._entry(session_id)
        self._expect(session_id, e, KVState.GONE, "reprefilled")
        e.state = KVState.RESIDENT

    def release(self, session_id: str) -> None:
        """The session ended (or moved away): forget it and free its host blocks, whatever its
        state; a move in flight is abandoned (its driver drops the transfer's result)."""
        e = self._sessions.pop(session_id, None)
        if e is not None:
            self._free_blocks(e)

    # --- internals ----------------------------------------------------------------------------
    def _entry(self, session_id: str) -> _Entry:
        e = self._sessions.get(session_id)
        if e is None:
            raise KeyError(f"host pool: session {session_id!r} has no host state")
        return e

    @staticmethod
    def _expect(session_id: str, e: _Entry, state: KVState, what: str) -> None:
        if e.state is not state or e.moving:
            now = e.state.value + (f" ({e.moving} in flight)" if e.moving else "")
            raise ValueError(f"{what} {session_id!r}: its KV is {now}, not {state.value}")

    def _moving(self, session_id: str, move: str, what: str) -> _Entry:
        e = self._entry(session_id)
        if e.moving != move:
            raise ValueError(f"{what} {session_id!r}: no {move} in flight")
        return e

    def _free_blocks(self, e: _Entry) -> None:
        self._free.extend(reversed(e.blocks))
        e.blocks = []
        e.tokens = 0
