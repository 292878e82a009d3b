"""A session's KV in the decode worker's host KV tier (``LiveTier``, services/decode/tier.py): its host
copy, and the two moves that make and use it.

- an offload (``offload_now``) is a WRITE of the session's device blocks into host blocks, a prefetch
  (``prefetch_now``) a READ back into blocks reserved for it: the worker's KV transport, and the same
  ranges, as a remote prefill's.
- every move is checked: an offload's host bytes must equal the device bytes they came from (byte
  for byte), and a prefetch's device bytes must have the CRC-32 of every host block taken then, so
  that a host copy changed while it sat there is caught too.
- a move that fails (a transfer error, a check that does not hold, no free host or device block)
  loses that copy of the KV, never the session: its next round prefills the history again from the
  session's tokens (``kv_recomputed_tokens``), as after an eviction.
- with --prefix-sharing a session's shared blocks (``SessionKV.choose_pin``, ``pinned``) stay on the
  device: an offload moves positions from there on (``HostCopy.start``), a prefetch reads them back
  after the pinned blocks, and a failed move loses only the own part.

A round that prefills from the host copy instead of waiting for its prefetch: services/decode/hostread.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog

from ampd.kv import KVPoolExhausted, KVTransferError
from ampd.worker import KVMove
from services.decode.hostread import block_crcs, block_segments

if TYPE_CHECKING:
    from services.decode.session import Session
    from services.decode.tier import LiveTier

__all__ = ["HostCopy", "offload_now", "prefetch_now"]

log = structlog.get_logger()


@dataclass(slots=True)
class HostCopy:
    """A session's KV in the host pool: positions [``start``, ``start + tokens``) in ``blocks``,
    ``crcs`` the CRC-32 of each block's bytes. ``start``: the pinned prefix (--prefix-sharing:
    blocks the prefix index holds, which stayed on the device; 0 otherwise)."""

    blocks: list[int]
    tokens: int
    crcs: list[int]
    start: int = 0


async def offload_now(t: LiveTier, s: Session, m: KVMove) -> None:
    """Write the session's device KV (less a pinned prefix) into host blocks, check it, free
    the device blocks (``LiveTier``'s offload, after the session's previous move)."""
    w, sid, p = t.w, s.session_id, s.kv.pinned
    n = s.kv.tokens - p
    if s.closed or n <= 0 or sid in t.copies:
        return
    if sid in t.fetching:  # its prefetch is already listed (the result came first): the KV stays
        log.info("kv offload skipped: the prefetch follows", session=sid, tokens=n, reason=m.reason)
        return
    pool, bpt = w.rt.pool, t.pool.bytes_per_token
    try:
        blocks = t.pool.alloc(t.pool.blocks_for(n))
    except KVPoolExhausted:  # the core's count freed blocks a prefetch still reads
        t._failed(s, "offload", "host-busy", f"no free host block for {n} tokens")
        return
    src, dst = s.kv.segments(p, n), block_segments(blocks, n, t.pool.block_tokens)
    t0 = time.perf_counter()
    err = ""
    try:
        await w.rt.transport.write(t.name, src, dst)
        host = t.pool.read(dst, copy=False)
        if not np.array_equal(host, pool.read(src, copy=False)):
            err = "mismatch"
    except KVTransferError as exc:
        err = f"transfer: {exc}"
    if s.closed or err:
        t.pool.free(blocks)
        if err and not s.closed:
            t._failed(s, "offload", err.split(":")[0], err)
        return
    t.copies[sid] = HostCopy(blocks, n, block_crcs(t.pool.read(dst), t.pool.block_bytes), p)
    s.kv.keep_pinned(pool)
    t._count(f"kv_tier_move_offload:{m.reason}")
    t._count("kv_tier_bytes_to_host", n * bpt)
    log.info("kv offloaded", session=sid, tokens=n, pinned=p, reason=m.reason, ms=round(1e3 * (time.perf_counter() - t0), 2))


async def prefetch_now(t: LiveTier, s: Session, m: KVMove) -> None:
    """Read the session's host copy back into device blocks reserved now, and check it (``LiveTier``'s
    prefetch of a round that was not claimed: hostread.py)."""
    w, sid = t.w, s.session_id
    copy = t.copies.pop(sid, None)
    if copy is None or s.closed or s.kv.tokens != copy.start:  # lost before (counted then), or never left
        t.fetching.pop(sid, None)
        if copy is not None:
            t.pool.free(copy.blocks)
        return
    pool, bt = w.rt.pool, t.pool.block_tokens
    # the positions the session still has (``m.tokens``: the core's count, less after a rewound
    # turn), read as whole host blocks: each block's CRC covers the block
    keep = min(copy.tokens, m.tokens)
    n = min(copy.tokens, -(-keep // bt) * bt)
    t0 = time.perf_counter()
    err = ""
    try:
        async with t.moved:  # the blocks the core counts free may still be leaving
            await t.moved.wait_for(lambda: pool.available_tokens >= n or not t.running_offloads)
        dest = s.kv.reserve(pool, n)
        t.fetching.pop(sid, None)  # reserved: the pool counts it now
        await w.rt.transport.read(t.name, block_segments(copy.blocks, n, bt), dest)
        got = block_crcs(pool.read(dest), t.pool.block_bytes)
        if got != copy.crcs[:len(got)]:
            err = "mismatch"
    except KVPoolExhausted as exc:
        err = f"device-full: {exc}"
    except KVTransferError as exc:
        err = f"transfer: {exc}"
    finally:
        t.pool.free(copy.blocks)  # the transfer has ended either way
    if s.closed:
        return
    if sid in t.dropped:  # evicted meanwhile (``evicted``): the blocks go, the history is prefilled again
        t.dropped.discard(sid)
        s.recompute = copy.start + keep
        s.kv.release(pool)
        return
    if err:  # its own part is prefilled again (a pinned prefix stays)
        s.kv.keep_pinned(pool)
        s.recompute = keep
        t._failed(s, "prefetch", err.split(":")[0], err)
        return
    s.kv.commit(n)
    if keep < n:
        s.kv.truncate(pool, copy.start + keep)
    t._count(f"kv_tier_move_prefetch:{m.reason}")
    t._count("kv_tier_bytes_from_host", n * t.pool.bytes_per_token)
    log.info("kv prefetched", session=sid, tokens=n, reason=m.reason,
             ms=round(1e3 * (time.perf_counter() - t0), 2))
