"""The decode worker's KV: the core admits by the pool's real free space, and the blocks of sessions
whose KV the core evicted (--kv-evict) go back to the pool."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from ampd.policy import WorkerView
from ampd.worker import PREFILLING
from services.decode.session import Session
from services.decode.tier import host_tokens

if TYPE_CHECKING:
    from services.decode.worker import DecodeWorker

log = structlog.get_logger()


class KvSync:
    """Between the pool and the core: ``sync`` before each admission decision and each view,
    ``admit_waiting`` when KV freed, ``room_for`` right before a round reserves its blocks."""

    def __init__(self, w: DecodeWorker) -> None:
        self.w = w
        self.core = w.core

    def sync(self, room: int = 0) -> None:
        """The core admits by the pool's free space (``room``: what the deciding session's partial
        last block still holds), less what the host tier owes the pool (charged, not yet reserved)."""
        tier = self.w.tier
        # available: free, and the prefix blocks nobody holds (--prefix-sharing), which the pool
        # takes back before an allocation would fail
        owed = 0
        if tier is not None:
            owed = tier.owed() + self.outputs_due()
            self.w.prefix.own_pins()  # whose pinned prefix dropping would free (--prefix-sharing)
        self.core.sync_kv_free(self.w.rt.pool.available_tokens + room - owed)

    def outputs_due(self) -> int:
        """The host tier: what the running rounds' output will still take from the pool, in its
        blocks. The core charged each round's whole output at admission (``DecodeCore.output_due``:
        the part not made yet), the pool reserves it a token a step, into the session's last block
        first; a round whose start waits (``LiveTier.defer``) is counted without that block's room,
        which its input takes first."""
        w, core = self.w, self.core
        bt = w.rt.pool.block_tokens
        n = 0
        for c in core.sessions.values():
            due = core.output_due(c)
            s = w.sessions.get(c.session_id)
            if not due or s is None:
                continue
            kv = s.kv
            room = 0 if s.session_id in w.tier.deferred else len(kv.blocks) * bt - kv.tokens - kv.reserved
            n += -(-max(0, due - room) // bt) * bt
        return n

    def published(self, now: float) -> tuple[WorkerView, float]:
        """What the worker publishes (``WorkerRuntime.published``): the core's view by the pool's
        free space, and the end of the local prefill in service (0: none)."""
        self.sync()
        core = self.core
        return core.view(now), (core.busy_until if core.state == PREFILLING else 0.0)

    def admit_waiting(self) -> None:
        """KV freed: start the waiting rounds that fit now, in the core's order."""
        while True:
            self.sync()
            c = self.core.admit_next(time.time())
            # victims the core counted nothing for (a dropped pinned prefix: its blocks may be free
            # now, cached) may have made the room: look again by the pool's count
            if not self.free_evicted() and c is None:
                return
            if c is None:
                continue
            self.w.start_round(self.w.sessions[c.session_id])

    # ------------------------------------------------------------------------ KV eviction
    def free_evicted(self) -> int:
        """The core evicted these idle sessions' KV (--kv-evict): their blocks go back to the pool.
        Each keeps its tokens (``s.tokens``), so its next round prefills the whole history again, as
        a session moved here from a lost worker does (l_hist 0), routed like any prefill. Returns
        how many the core evicted."""
        victims = self.core.take_victims()
        if self.w.tier is not None:
            self.w.tier.take()  # the moves the admission listed (offloads of idle KV, this round's prefetch)
        for c in victims:
            s = self.w.sessions.get(c.session_id)
            if s is None or s.core is not c:
                continue
            s.recompute = s.kv.tokens + (host_tokens(self.w.tier, s) if self.w.tier is not None else 0)
            if self.w.tier is None or not self.w.tier.evicted(s):  # (else the prefetch in flight lets go)
                s.kv.release(self.w.rt.pool)
            self.w.metrics["kv_evictions"] += 1
            log.info("KV evicted", session=s.session_id, tokens=s.recompute)
        return len(victims)

    def make_room(self, tokens: int) -> None:
        """The host tier: a round about to start finds the pool short of ``tokens``: idle sessions'
        KV goes (offloads the tier starts, or drops) until the core counts them free. A dropped
        pinned prefix that others read frees nothing by the core's count (it drops one such a call):
        the pool's count says what it freed, so look again while victims come and it is short."""
        pool = self.w.rt.pool
        while True:
            self.sync()
            self.core.make_room(tokens)
            if not self.free_evicted() or pool.available_tokens >= tokens:
                return

    def room_for(self, s: Session) -> None:
        """Right before a round reserves its KV: evict more idle sessions while the pool itself lacks
        the room. The core admitted the round by its own count, and the pool differs from it by a
        token or so per session (a victim's blocks hold its history less the last output token, and
        the round's prefill writes that token too)."""
        pool = self.w.rt.pool
        room = len(s.kv.blocks) * pool.block_tokens - s.kv.tokens
        # available: cached prefix blocks nobody holds go back before any idle session is evicted
        while pool.available_tokens + room < s.l_incr:
            self.sync(room)
            self.core.make_room(s.l_incr)
            if not self.free_evicted():
                return  # nothing left to evict: the reservation fails the session
