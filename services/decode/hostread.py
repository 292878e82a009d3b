"""Remote prefill from the host copy (docs/kv.md "Remote prefill from the host copy").

A round whose KV is in the host tier when it starts need not wait for its fetch back to the device.
As it starts (``LiveTier.defer``), ``claim`` reserves at once the device blocks of both the history
the fetch brings back and the round's new KV, and takes the host copy over from the prefetch the core
listed for it. The round's prefill task names the host copy's blocks (``PrefillTask.history_on_host``):
a prefill worker reads the history from the host tier's NIXL agent (published with the worker's
registration, ``WorkerInfo.host_agent``), byte-checked as every read is, while the prefetch reads the
same host blocks into the device blocks reserved for them (its CRC-32 check as always); the new KV is
written into the device pool as before. That is Eq. (2) as the simulator times it: the remote prefill
ends at the later of its own time and the fetch (``ampd.policy.route.remote_after_fetch``).

The round's first token waits for the fetch (decode reads the history on the device): a PrefillDone
that comes first is handled once the fetch ended (``after_fetch``), and a round that runs here instead
(the coordinator routed it here, its prefill worker failed or was lost, it is overdue) queues once the
fetch ended (``local``). The host blocks go once both readers are done: the fetch, and the prefill
worker if its task went out (until its PrefillDone, or a local route from the coordinator; at most
REMOTE_HOLD_S after the fetch otherwise). A fetch that fails loses the device copy, never the session: the round prefills its
history again from the session's tokens (``kv_recomputed_tokens``), as after any failed prefetch.

Claimed only when the whole copy comes back unchanged (no rewound turn, no pinned shared prefix: the
history has one source) and the device has room for history and input now; otherwise the round waits
for its fetch as before, and its task says so (``PrefillTask.kv_fetch_first``, kvwhere.py): the router
counts the fetch and then the remote prefill.
"""
from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import structlog

from ampd.kv import KVPoolExhausted, KVTransferError, Segment
from ampd.policy.kvwhere import KVWhere
from ampd.policy.types import KV_GONE
from services.decode.session import REMOTE_HOLD_S

if TYPE_CHECKING:
    from services.decode.session import Session
    from services.decode.hostcopy import HostCopy
    from services.decode.tier import LiveTier

__all__ = ["HostRead", "HostReads", "block_crcs", "block_segments"]

log = structlog.get_logger()


def block_segments(blocks: list[int], tokens: int, block_tokens: int) -> list[Segment]:
    """Segments of the first ``tokens`` positions of ``blocks``, whole blocks but the last."""
    out, left = [], tokens
    for b in blocks:
        if left <= 0:
            break
        out.append(Segment(b, 0, min(block_tokens, left)))
        left -= block_tokens
    return out


def block_crcs(data: np.ndarray, block_bytes: int) -> list[int]:
    """The CRC-32 of each ``block_bytes`` of ``data`` (a host copy's check, ``HostCopy.crcs``)."""
    return [zlib.crc32(data[i:i + block_bytes]) for i in range(0, data.size, block_bytes)]


@dataclass(slots=True, eq=False)
class HostRead:
    """A round prefilled from the host copy: ``src`` the host segments a prefill worker reads,
    ``hist`` the device positions [0, ``l_hist``) the fetch fills, ``dest`` the round's new KV."""

    session_id: str
    rnd: int
    copy: HostCopy
    src: list[Segment]
    hist: list[Segment]
    dest: list[Segment]
    fetched: bool = False  # the fetch ended (well or not)
    error: str = ""  # why the fetch failed ("": it did not)
    remote_done: bool = True  # no prefill worker reads the host copy (its task not sent, or reported)
    redone: bool = False  # the round was started again, prefilling its history from tokens
    freed: bool = False  # the host blocks went
    waiters: list[Callable[[], None]] = field(default_factory=list)  # run once the fetch ended

    @property
    def l_hist(self) -> int:
        return self.copy.tokens


class HostReads:
    """The live tier's rounds prefilled from the host copy, by session (module doc)."""

    def __init__(self, tier: LiveTier) -> None:
        self.tier = tier
        self.active: dict[str, HostRead] = {}
        # the host tier's agent, registered with the worker (WorkerInfo.host_agent): prefill workers
        # add it as a peer of theirs and read histories from it
        tier.w.rt.host_peer = (tier.name, tier.transport.metadata(), tier.pool.layout.to_dict())

    def claim(self, s: Session) -> bool:
        """The round of ``s`` starts now on its host copy (module doc): True when claimed."""
        t, sid = self.tier, s.session_id
        copy, old = t.copies.get(sid), self.active.get(sid)
        # (the core's count of the history includes the last output token, whose KV the round computes)
        if (copy is None or copy.start or (old is not None and not old.freed) or t.fetching.get(sid, -1) < copy.tokens
                or s.kv.tokens or s.kv.reserved or s.recompute):
            return False
        n = copy.tokens
        l_incr = len(s.tokens) - n
        if l_incr <= 0:
            return False
        pool = t.w.rt.pool
        try:
            s.kv.reserve(pool, n + l_incr)
        except KVPoolExhausted:  # no room now: the round waits for its fetch, which waits for room
            return False
        del t.copies[sid]
        t.fetching.pop(sid, None)  # reserved: the pool counts it now
        self.active[sid] = HostRead(sid, s.round, copy, block_segments(copy.blocks, n, t.pool.block_tokens),
                                    s.kv.segments(0, n), s.kv.segments(n, l_incr))
        t._count("kv_tier_host_reads")
        return True

    def get(self, s: Session) -> HostRead | None:
        """The claim of the round of ``s`` now, unless it was started again from tokens."""
        r = self.active.get(s.session_id)
        return r if r is not None and r.rnd == s.round and not r.redone else None

    def sent(self, r: HostRead) -> None:
        """Its prefill task goes out (a prefill worker reads the host copy until it reports): before
        the fetch ended, the point of it all (counted)."""
        r.remote_done = False
        if not r.fetched:
            self.tier._count("kv_tier_host_read_ahead")

    async def fetch(self, s: Session, reason: str) -> None:
        """The claimed round's prefetch: the host copy into the device blocks reserved at the claim."""
        t = self.tier
        r = self.active[s.session_id]
        pool, t0, err = t.w.rt.pool, time.perf_counter(), ""
        try:
            await t.w.rt.transport.read(t.name, r.src, r.hist)
            if block_crcs(pool.read(r.hist), t.pool.block_bytes) != r.copy.crcs:
                err = "mismatch"
        except KVTransferError as exc:
            err = f"transfer: {exc}"
        r.fetched = True
        if err and not s.closed:  # (kept until the round starts again: ``redo``)
            r.error = err
            t._count(f"kv_tier_failed_prefetch:{err.split(':')[0]}")
            log.warning("kv prefetch failed; the round prefills the history again", session=s.session_id,
                        error=err, tokens=r.l_hist)
        elif not s.closed:
            s.kv.commit(r.l_hist)
            t._count(f"kv_tier_move_prefetch:{reason}")
            t._count("kv_tier_bytes_from_host", r.l_hist * t.pool.bytes_per_token)
            log.info("kv prefetched", session=s.session_id, tokens=r.l_hist, reason=reason, host_read=True,
                     ms=round(1e3 * (time.perf_counter() - t0), 2))
        self._settle(r)
        asyncio.get_running_loop().call_later(REMOTE_HOLD_S, self._free, r)  # a reader that never reports
        waiters, r.waiters = r.waiters, []
        for fn in waiters:
            fn()

    def after_fetch(self, s: Session, fn: Callable[[], None]) -> bool:
        """True when the round of ``s`` waits for its fetch: ``fn`` runs once it ended."""
        r = self.get(s)
        if r is None or r.fetched:
            return False
        r.waiters.append(fn)
        return True

    def redo(self, s: Session) -> bool:
        """True when the round's fetch failed: the round starts again, its history prefilled from
        the session's tokens (the device copy is lost; the host blocks go once no reader is left)."""
        r = self.get(s)
        if r is None or not r.fetched or not r.error or s.closed:
            return False
        r.redone = True
        if r.freed:  # (no reader left: the record goes too)
            self._free(r)
        w = self.tier.w
        # The blocks reserved at the claim stay the session's (none is committed; ``start_round``'s
        # reserve keeps them): a prefill worker that went overdue may still write its new KV into
        # them, and a freed block could by then be another session's.
        s.recompute = r.l_hist
        s.where = (s.round, KVWhere(KV_GONE, 0.0))
        w.rt.changed()
        w.start_round(s)
        return True

    def local(self, s: Session) -> bool:
        """The round of ``s`` is to run here: True when it waits for its fetch (then it queues), or
        its fetch failed (then it starts again from tokens); False: it queues now."""
        rnd = s.round

        def again() -> None:
            if not s.closed and s.round == rnd:
                self.tier.w.queue_local(s)

        return self.after_fetch(s, again) or self.redo(s)

    def remote_ended(self, session_id: str, rnd: int) -> None:
        """No prefill worker reads the host copy of the round any more (its PrefillDone came, or the
        task never left: a local route)."""
        r = self.active.get(session_id)
        if r is not None and r.rnd == rnd:
            r.remote_done = True
            self._settle(r)

    def _settle(self, r: HostRead) -> None:
        if r.fetched and r.remote_done:
            self._free(r)

    def _free(self, r: HostRead) -> None:
        if not r.freed:
            r.freed = True
            self.tier.pool.free(r.copy.blocks)
        if self.active.get(r.session_id) is r and (not r.error or r.redone):  # a failed fetch: until redone
            del self.active[r.session_id]

    def writing(self, s: Session) -> bool:
        """A prefill worker may still write the blocks of the session's claimed round (it ended
        meanwhile; ``RemotePrefills.hold``): they stay until it reports, not only until the fetch ended."""
        return self.get(s) is not None and (s.session_id, s.round) in self.tier.w.remote.held

    def stop(self) -> None:
        for r in list(self.active.values()):
            self._free(r)
