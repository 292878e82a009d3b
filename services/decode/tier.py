"""The host KV tier of the live decode worker (``--kv-host-ratio``, ``--kv-host-mb``; its decisions:
``ampd.worker.decode_tier``).

Off (``--kv-host-ratio 0`` and ``--kv-host-mb 0``) nothing here runs. On (ratio 1 by default), the
worker sizes the host pool at start-up (services/decode/tiersize.py: it must hold one session's KV,
and the engine's KV must live in the worker's pool: the mock's checkable bytes, the torch engine's
real KV; SGLang keeps its own). Then:

- the host pool is a ``KVPool`` of its own, registered with a second KV transport agent of the
  worker's kind (NIXL in the services: registering pins it), which the worker's agent knows as a
  peer. The moves, each checked byte for byte, and what a failed one loses (that copy of the KV,
  never the session): services/decode/hostcopy.py.
- the core decides (``DecodeCore.tier_pause`` when a round ends in a tool call, the client's next
  turn included; its admission when the result arrives; ``tier_prefetch`` at the tool's expected
  end with ``--kv-prefetch-early``) and does the accounting at once; this driver performs the moves
  it lists (``take_moves``), one after the other per session, and a round whose KV is moving (or
  whose blocks an offload is freeing) starts once the moves are done (or, its KV on host, prefills
  from the host copy: services/decode/hostread.py). Meanwhile the core admits by the pool's free
  space less what it charged and the pool has not reserved yet (``owed``, and the running rounds'
  output: ``KvSync.outputs_due``); KV it counts free that an offload still holds only makes it
  admit later, never twice.
- after a failed move the core's charge for the session's next round (history plus input) is what
  its re-prefill writes, so its accounting needs no correction.
- with --prefix-sharing a session's shared blocks (``SessionKV.choose_pin``, ``pinned``) stay on the
  device while its own KV moves. A session dropped (the policy's drop, an eviction) releases all of
  it, its references included.
- the tool durations the policy reads (``HostTier.durations``) are the sidecar's (each server-side
  call's started..finished) and, for client-side calls and client turns, the time from the round's
  end to the turn that answers it.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from ampd.kv import KVPool
from ampd.tasks import BackgroundTasks
from ampd.worker import TO_HOST, KVMove
from services.decode import kvwhere
from services.decode.hostcopy import HostCopy, offload_now, prefetch_now
from services.decode.hostread import HostReads

if TYPE_CHECKING:
    from services.decode.session import Session
    from services.decode.worker import DecodeWorker

__all__ = ["LiveTier", "pause", "CLIENT_TURN", "TIER_METRICS"]

log = structlog.get_logger()

CLIENT_TURN = "client-turn"  # the pause of a turn that ended without a call: until the client's next turn
# the tier's counters in the worker's Metrics reply (ampd/metrics.py DECODE); decisions and moves
# add "kv_tier_decision_<action>:<reason>", "kv_tier_move_<kind>:<reason>", "kv_tier_failed_<kind>:<why>"
TIER_METRICS = ("kv_tier_bytes_to_host", "kv_tier_bytes_from_host", "kv_tier_host_reads", "kv_tier_host_read_ahead")


def pause(w: DecodeWorker, s: Session, scripted, parsed: list) -> None:
    """The round of ``s`` ended with the turn's ``scripted`` call, the calls ``parsed`` from its
    output, or none (the client's next turn comes): the core makes its KV evictable (--kv-evict),
    or the host tier keeps, offloads or drops it (by the first call's tool and the turn's hint).
    When KV freed while rounds wait, they are admitted."""
    if w.tier is None or (s.closing and scripted is None and not parsed):  # (a closing session's KV stays)
        freed = w.core.tool_call(s.core)
    else:
        tool = (scripted.tool.name or "replay") if scripted is not None else parsed[0].name if parsed else CLIENT_TURN
        hints = s.turn.hints
        freed = w.tier.pause(s, tool, hints.expected_tool_s if hints.HasField("expected_tool_s") else None)
    if freed:
        w.kv.admit_waiting()


class LiveTier:
    """The host pool, its transport agent, the host copies and the moves in flight (module doc)."""

    def __init__(self, w: DecodeWorker, blocks: int) -> None:
        self.w = w
        self.core = w.core
        rt = w.rt
        dev = rt.pool
        self.pool = KVPool(blocks, dev.block_tokens, dev.bytes_per_token)
        self.name = f"{rt.agent_name}-host"
        # an agent of the worker's own transport class: NIXL in the services, the loopback in tests
        self.transport = type(rt.transport)(self.name, self.pool)
        rt.transport.add_peer(self.name, self.transport.metadata(), self.pool.layout)
        self.reads = HostReads(self)  # rounds whose prefill reads the host copy (registers it with the worker)
        self.copies: dict[str, HostCopy] = {}
        self.busy: dict[str, asyncio.Task] = {}  # session id -> its latest move (moves chain per session)
        self.running_offloads = 0  # of them, those whose transfer runs
        self.moved = asyncio.Condition()  # notified whenever a move ends
        # what the core has charged but the pool has not reserved yet: the rounds whose start waits
        # (``defer``) and the early prefetches before their blocks are reserved (``owed``)
        self.deferred: dict[str, Session] = {}
        self.fetching: dict[str, int] = {}  # session id -> tokens its prefetch will reserve
        self.fetch_began: dict[str, tuple[float, int]] = {}  # session id -> (when, tokens) of its prefetch
        self.dropped: set[str] = set()  # sessions evicted (dropped) while their prefetch ran
        self.paused: dict[str, tuple[str, float]] = {}  # session id -> (tool, when its round ended)
        self.early: dict[str, asyncio.TimerHandle] = {}  # session id -> its early prefetch
        self.counts: dict[str, float] = dict.fromkeys(TIER_METRICS, 0)
        self.tasks = BackgroundTasks()

    @property
    def pending_offloads(self) -> int:
        """Offloads not ended (device blocks the core counts free, still held); the core's count,
        which its last resort waits for (``HostTier.pending_offloads``)."""
        return self.core.tier.pending_offloads

    @pending_offloads.setter
    def pending_offloads(self, n: int) -> None:
        self.core.tier.pending_offloads = n

    # ------------------------------------------------------------------------------- events
    def pause(self, s: Session, tool: str, hint_s: float | None) -> bool:
        """The round of ``s`` ended in a call to ``tool`` (CLIENT_TURN: none; the client's next turn
        comes): the core keeps, offloads or drops its KV; the moves start. True when rounds wait
        and KV freed (the caller admits them)."""
        c = s.core
        now = time.time()
        self.paused[s.session_id] = (tool, now)
        self.w.kv.sync()  # the pressure the core decides by is the pool's
        c.pinned = s.kv.choose_pin()  # --prefix-sharing: its blocks others also read stay on the device
        freed = self.core.tier_pause(c, now, tool, hint_s)
        d = self.core.tier.last
        if d is not None:
            log.info("kv tier decision", session=s.session_id, tool=tool, action=d.action, reason=d.reason,
                     **{k: round(v, 4) for k, v in d.estimates.items()})
        if c.evicted and s.kv.tokens:  # dropped: its next round prefills the history again
            self._lose(s, "")
        self.take()
        at = self.core.tier_prefetch_at(c)
        if at is not None:
            self.early[s.session_id] = asyncio.get_running_loop().call_later(max(0.0, at - now), self._early, s)
        return freed

    def resumed(self, s: Session, duration_s: float | None = None) -> None:
        """The call the session paused for answered (its next round's input is here): its tool's
        duration joins the tool's estimate (``duration_s``: the sidecar's; else since the pause)."""
        got = self.paused.pop(s.session_id, None)
        timer = self.early.pop(s.session_id, None)
        if timer is not None:
            timer.cancel()
        if got is not None:
            tool, t0 = got
            now = time.time()
            self.core.tier.durations.observe(tool, now, now - t0 if duration_s is None else duration_s)

    def _early(self, s: Session) -> None:
        """The tool's expected end nears (``--kv-prefetch-early``): the KV comes back if there is room."""
        self.early.pop(s.session_id, None)
        if s.closed:
            return
        self.w.kv.sync()
        if self.core.tier_prefetch(s.core, time.time()):
            self.take()

    def evicted(self, s: Session) -> bool:
        """The core dropped the KV of ``s`` for a round that needed the room (an idle session whose
        early prefetch may still be writing its blocks). True when that prefetch is in flight: it
        frees the blocks when its transfer ends, instead of committing them."""
        task = self.busy.get(s.session_id)
        if task is None or task.done():
            self._free_copy(s.session_id)  # (a session offloaded with a pinned prefix: the copy goes too)
            return False
        self.dropped.add(s.session_id)
        return True

    def close(self, s: Session) -> bool:
        """The session ended: its host copy goes (now, or when the move in flight ends). True when a
        move in flight holds its device blocks: the tier frees them when it ends."""
        sid = s.session_id
        self.paused.pop(sid, None)
        timer = self.early.pop(sid, None)
        if timer is not None:
            timer.cancel()
        task = self.busy.get(sid)
        if task is not None and not task.done():
            return True
        self._free_copy(sid)
        return False

    async def stop(self) -> None:
        for timer in self.early.values():
            timer.cancel()
        self.early.clear()
        await self.tasks.close()
        self.reads.stop()
        self.w.rt.transport.remove_peer(self.name)
        for sid in list(self.copies):
            self._free_copy(sid)
        await self.transport.aclose()

    # -------------------------------------------------------------------------------- moves
    def take(self) -> None:
        """Start the moves the core listed, each after its session's previous one."""
        for m in self.core.take_moves():
            s = self.w.sessions.get(m.session_id)
            if s is None or s.core.session_id != m.session_id:
                continue
            prev = self.busy.get(m.session_id)
            if m.direction == TO_HOST:
                self.pending_offloads += 1
                task = self.tasks.spawn(self._offload(s, m, prev), name=f"kv-offload-{m.session_id}")
            else:
                self.fetching[m.session_id] = m.tokens
                self.fetch_began[m.session_id] = (time.time(), m.tokens)
                task = self.tasks.spawn(self._prefetch(s, m, prev), name=f"kv-prefetch-{m.session_id}")
            self.busy[m.session_id] = task
            task.add_done_callback(lambda t, sid=m.session_id: self._ended(sid, t))

    def _ended(self, sid: str, task: asyncio.Task) -> None:
        if self.busy.get(sid) is task:
            del self.busy[sid]

    def defer(self, s: Session) -> bool:
        """Called as the round of ``s`` starts: True when it must wait (its KV is moving, or the
        blocks it needs are still held by offloads the core counts done); it starts when they end.
        The round's KV location is taken first, before any wait (its route: services/decode/kvwhere.py)."""
        kvwhere.note(self.w, s)
        task = self.busy.get(s.session_id)
        idle = task is None or task.done()
        if not idle and self.reads.claim(s):  # on host: its prefill reads the host copy as it comes back
            return False
        if idle and not self._freeing() and self._short(s):
            # the pool is short of what the core counted (--prefix-sharing: a block shared by
            # several sessions is charged to each, so dropping one frees less): idle KV goes now
            self.w.kv.make_room(self._missing(s))
        if idle and not (self._freeing() and self._short(s)):
            return False
        # the coordinator's route goes with it (it holds if the round's KV is what it was told)
        self.deferred[s.session_id] = s
        self.tasks.spawn(self._start_later(s, s.round, task, s.route), name=f"kv-wait-{s.session_id}")
        return True

    def _missing(self, s: Session) -> int:
        """Tokens of the session's history and input that no block of it holds yet."""
        room = len(s.kv.blocks) * self.w.rt.pool.block_tokens - s.kv.tokens
        return len(s.tokens) - s.kv.tokens - room

    def _freeing(self) -> bool:
        """Moves in flight will free device blocks the core counts free already: offloads, and the
        prefetches of sessions evicted meanwhile."""
        return bool(self.pending_offloads or self.dropped)

    def _short(self, s: Session) -> bool:
        return self.w.rt.pool.available_tokens < self._missing(s)

    def owed(self) -> int:
        """Tokens the core has charged that the pool has not reserved yet, but the running rounds'
        output (``KvSync.outputs_due``): the core admits by the pool's free space less these
        (``KvSync.sync``), or it would give them away twice."""
        n = sum(max(0, self._missing(s)) for s in self.deferred.values())
        return n + sum(v for sid, v in self.fetching.items() if sid not in self.deferred)

    async def _start_later(self, s: Session, rnd: int, task: asyncio.Task | None, route) -> None:
        try:
            if task is not None:
                await asyncio.wait([task])
            async with self.moved:
                await self.moved.wait_for(lambda: not (self._freeing() and self._short(s)))
        finally:
            if self.deferred.get(s.session_id) is s:
                del self.deferred[s.session_id]
        if not s.closed and s.round == rnd and self.w.sessions.get(s.session_id) is s:
            s.route = route
            try:
                self.w.start_round(s)
            finally:
                s.route = None

    async def _offload(self, s: Session, m: KVMove, prev: asyncio.Task | None) -> None:
        try:
            if prev is not None:
                await asyncio.wait([prev])
            self.running_offloads += 1
            try:
                await offload_now(self, s, m)
            finally:
                self.running_offloads -= 1
        finally:
            self.pending_offloads -= 1
            if s.session_id in self.dropped:  # evicted while it ran (its pinned prefix was left)
                self.dropped.discard(s.session_id)
                self._free_copy(s.session_id)
                s.kv.release(self.w.rt.pool)
            self._after_move(s)
            async with self.moved:
                self.moved.notify_all()
            self.w.kv.admit_waiting()  # device blocks freed: waiting rounds may fit

    async def _prefetch(self, s: Session, m: KVMove, prev: asyncio.Task | None) -> None:
        try:
            if prev is not None:
                await asyncio.wait([prev])
            if self.reads.get(s) is not None:  # claimed (hostread.py): into the blocks reserved then
                await self.reads.fetch(s, m.reason)
            else:
                await prefetch_now(self, s, m)
        finally:
            self.fetching.pop(s.session_id, None)
            self.fetch_began.pop(s.session_id, None)
            if s.session_id in self.dropped:  # it ended before its transfer: nothing was reserved
                self.dropped.discard(s.session_id)
                s.kv.release(self.w.rt.pool)
            self._after_move(s)
            async with self.moved:  # blocks of an evicted session may have gone: waiting rounds look again
                self.moved.notify_all()

    # ------------------------------------------------------------------------------ helpers
    def _after_move(self, s: Session) -> None:
        """A move of ``s`` ended: a session closed meanwhile lets go of what the tier held for it."""
        later = self.busy.get(s.session_id)  # a move chained after this one lets go instead
        if s.closed and (later is None or later is asyncio.current_task()) and not self.reads.writing(s):
            s.kv.release(self.w.rt.pool)
            self._free_copy(s.session_id)
            self.w.rt.changed()

    def _free_copy(self, sid: str) -> None:
        copy = self.copies.pop(sid, None)
        if copy is not None:
            self.pool.free(copy.blocks)

    def _lose(self, s: Session, why: str) -> None:
        """The device copy of the session's KV goes (dropped: all of it, references too; a failed
        offload: all but a pinned prefix, which the core counts); its next round prefills the rest."""
        if why:
            p = s.kv.pinned
            s.recompute = s.kv.tokens - p
            s.kv.keep_pinned(self.w.rt.pool)
        else:
            s.recompute = s.kv.tokens
            s.kv.release(self.w.rt.pool)
        self.w.rt.changed()
        if why:
            log.warning("kv tier move failed; the next round prefills the history again", session=s.session_id,
                        error=why, tokens=s.recompute)

    def _failed(self, s: Session, kind: str, why: str, detail: str) -> None:
        self._count(f"kv_tier_failed_{kind}:{why}")
        if kind == "offload":
            self._lose(s, detail)
        else:
            log.warning("kv prefetch failed; the round prefills the history again", session=s.session_id,
                        error=detail, tokens=s.recompute)

    def _count(self, key: str, n: float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def metrics(self) -> dict[str, float]:
        """The tier's values for the worker's Metrics reply."""
        return tier_metrics(self)


def tier_metrics(t: LiveTier) -> dict[str, float]:
    """``t``'s counters, decisions and host pool use (``LiveTier.metrics``)."""
    out = dict(t.counts)
    for k, v in t.core.tier.decisions.items():
        out[f"kv_tier_decision_{k}"] = v
    out["kv_tier_host_used_blocks"] = t.pool.num_blocks - t.pool.free_blocks
    out["kv_tier_host_free_blocks"] = t.pool.free_blocks
    out["kv_tier_host_copies"] = len(t.copies)
    return out


def host_tokens(t: LiveTier, s: Session) -> int:
    """Tokens of the session's KV in its host copy (0: none)."""
    copy = t.copies.get(s.session_id)
    return 0 if copy is None else copy.tokens
