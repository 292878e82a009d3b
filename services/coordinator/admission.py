"""Admission of new sessions (the rule is ampd.policy.admit's, ``--admission``): a session is accepted
only when some decode worker has the KV it may need, net of what is promised to the sessions in
flight there, and, under the ``slo`` rule, when it can still meet its TTFT and ITL SLO there;
otherwise it waits, first come first served, up to ``admission_wait`` seconds (``slo``: no longer than
its TTFT budget lasts) in a queue of at most ``admission_queue`` sessions, or is refused
(RESOURCE_EXHAUSTED, with the reason). A session accepted is never aborted for lack of KV: its
promise is released only when it ends.

With ``promises`` (ampd.state.promises), the promises are shared with the deployment's other
coordinators through Redis: each judgement reads every coordinator's totals, and a promise is made
only if the worker's total stays within its capacity, so two coordinators never book the same KV.
A Redis that does not answer leaves each coordinator judging on its own promises."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import structlog

from ampd.policy import SLO, WorkerView
from ampd.policy.admit import HEAD_POLL_S, AdmissionBook, promise_room
from ampd.policy.types import DecodeCost
from ampd.state.promises import Promises
from ampd.state.store import REDIS_ERRORS
from ampd.tasks import BackgroundTasks
from services.coordinator.prefixes import PrefixChoice

log = structlog.get_logger()

__all__ = ["Admission", "Refused"]

# () -> (the live decode workers, each with its KV capacity as kv_free_tokens; the live prefill workers)
Rooms = Callable[[], Awaitable[tuple[Sequence[WorkerView], Sequence[WorkerView]]]]


class Refused(Exception):
    """The session is refused (RESOURCE_EXHAUSTED): ``reason`` is one of ampd.policy.admit's
    REFUSAL_REASONS, the message says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Admission:
    """The asyncio driver of ampd.policy.admit's ``AdmissionBook``: a waiting session sleeps on an
    event, which a release (the head) or the head leaving sets."""

    def __init__(self, wait_s: float, queue_max: int, rule: str = "kv", cost: DecodeCost | None = None,
                 slo: SLO | None = None, promises: Promises | None = None) -> None:
        self.book = AdmissionBook(rule, wait_s, queue_max, cost, slo)
        self.rule = rule
        self.promises = promises
        self._background = BackgroundTasks()  # the promise writes to Redis in flight
        # a session's release in flight: its next promise (a move's) lands after it
        self._releasing: dict[str, asyncio.Task] = {}
        self.promised = self.book.promised  # decode worker -> KV tokens promised to its live sessions
        self.sessions = self.book.sessions  # decode worker -> sessions admitted there, live

    @property
    def waiting(self) -> int:
        return len(self.book.waiting)

    async def admit(self, need: int, rooms: Rooms, l_incr: int = 0, since: float | None = None,
                    new: bool = True, sid: str = "", order_at: float | None = None,
                    prefer: PrefixChoice | None = None, expect: int | None = None,
                    stale: Callable[[str, str], None] | None = None) -> str:
        """A decode worker for a session that may need ``need`` KV tokens, with ``need`` promised to
        it. ``l_incr``: its first prefill's tokens; ``since``: when it arrived (time.monotonic());
        ``new``: False for a session already accepted (moved, or bound again for a later turn),
        which only the KV rule applies to; ``order_at``: its arrival made later by a yielding hint
        (ampd.policy.admit.AdmissionBook); ``prefer``: may move a new session to the worker holding
        the longest prefix of its prompt (services/coordinator/prefixes.py), the promise with it;
        ``expect``: the KV it is expected to hold (``out_mean``; the slo rule's ITL prediction, None:
        ``need``); ``stale``: called with the decode worker and secret of a stale copy of a new
        session, left there by a lost coordinator (ampd.state.promises). Raises Refused, or
        LookupError when no decode worker serves."""
        start = time.monotonic() if since is None else since
        book = self.book
        me = asyncio.Event()
        try:
            while True:
                decode, prefill = await rooms()
                if not decode:
                    raise LookupError("no decode worker is serving")
                pending = self._releasing.get(sid) if sid else None
                if pending is not None:  # its own release (a move's) lands before the totals are read
                    await asyncio.wait({pending})
                await self._refresh()
                share = book.off_device.share(time.time())  # (its samples are RoundTiming's unix times)
                v = book.judge(me, need, l_incr, time.monotonic() - start, decode, prefill, new, order_at, share,
                               expect)
                if v.reason:
                    raise Refused(v.reason, v.detail)
                if v.worker is not None:
                    wid = v.worker if prefer is None else self._move(v.worker, prefer(v.worker, decode, book.promised,
                                                                                        need), need)
                    # the room the book judged (device + what of the host tier stands in for it), for
                    # the shared check
                    cap = 0 if self.rule == "none" else next(promise_room(w, share, need) for w in decode
                                                             if w.worker_id == wid)
                    if await self._promise(sid, wid, need, cap, new, stale):
                        if prefer is not None:
                            prefer.bound(wid)
                        return wid
                    # another coordinator promised that KV meanwhile: judged again on the new totals
                    book.promised[wid] -= need
                    book.sessions[wid] -= 1
                    continue
                me.clear()
                # Woken by a release (the head) or by the head leaving. Only the head also looks
                # again twice a second (a new worker may have joined): many waiters must not poll.
                # None waits past its admission wait or its TTFT budget (slo): judged again, refused.
                try:
                    await asyncio.wait_for(me.wait(), min(v.wait_s, HEAD_POLL_S) if book.head is me else v.wait_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            if book.leave(me):
                self._wake()

    def _move(self, bound: str, to: str, need: int) -> str:
        """The book's promise of ``need`` (and its session) moves from ``bound`` to ``to``."""
        if to != bound:
            book = self.book
            book.release(bound, need)
            book.promised[to] += need
            book.sessions[to] += 1
        return to

    def add(self, worker: str, tokens: int, sid: str = "", shared: bool = True) -> None:
        """A later turn of an accepted session: it is not refused, but its KV is promised too.
        ``shared`` False: the promise is in Redis already (a reattached session's)."""
        self.book.add(worker, tokens)
        if self.promises is not None and sid and shared:
            self._spawn(self.promises.add(sid, worker, tokens), after=self._releasing.get(sid))

    def release(self, worker: str, tokens: int, sid: str = "") -> None:
        """A session ended (or left ``worker``): its promise is free for the waiting ones."""
        self.book.release(worker, tokens)
        if self.promises is not None and sid:
            task = self._releasing[sid] = self._spawn(self.promises.release(sid))
            task.add_done_callback(lambda t: self._releasing.pop(sid, None) if self._releasing.get(sid) is t else None)
        self._wake()

    def out_mean(self) -> float | None:
        """The windowed mean tokens of a round (ampd.policy.outlen), now; None without one."""
        return self.book.outputs.mean(time.time())  # (its samples are RoundTiming's unix times)

    def round_ended(self, t, prev: tuple[float, int] | None, tp: int) -> tuple[float, int]:
        """A session's round ended (its ``common_pb2.RoundTiming`` ``t``; ``prev``: what this returned
        for its previous round, None for its first) on a decode worker of degree ``tp``: a sample of
        how much KV can be on host (``ampd.policy.offshare``, admission's ``promise_room``). Returns
        the round's last token time and the session's KV then. Without the cost model (the host
        moves' times) there is no estimate, and admission promises the device only. Its tokens are
        a sample of the output lengths (``out_mean``)."""
        self.book.outputs.observe(t.last_token, t.tokens)
        kv = t.l_hist + t.l_incr + t.tokens  # (a recomputed history is in l_incr again)
        cost = self.book.cost
        if cost is not None:
            self.book.off_device.round_ended(t.input_ready, t.last_token, kv, None if prev is None else prev[0],
                                             0 if prev is None else prev[1], cost, tp)
        return t.last_token, kv

    async def promised_total(self) -> float:
        """KV tokens promised to live sessions: by every coordinator when shared (Redis), else here."""
        if self.promises is not None:
            try:
                return float(sum((await asyncio.wait_for(self.promises.totals(), 2.0)).values()))
            except (asyncio.TimeoutError, *REDIS_ERRORS):
                pass
        return float(sum(self.promised.values()))

    # ------------------------------------------------------------------------- shared (Redis)
    async def _refresh(self) -> None:
        """The book's promises become every coordinator's (its own included)."""
        if self.promises is None:
            return
        try:
            totals = await asyncio.wait_for(self.promises.totals(), 2.0)
        except (asyncio.TimeoutError, *REDIS_ERRORS):
            return  # judged on this coordinator's own view
        promised = self.book.promised
        promised.clear()
        promised.update(totals)

    async def _promise(self, sid: str, worker: str, need: int, capacity: int, new: bool,
                       stale: Callable[[str, str], None] | None) -> bool:
        if self.promises is None or not sid:
            return True
        try:
            out = await asyncio.wait_for(self.promises.promise(sid, worker, need, capacity, new), 2.0)
        except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
            log.warning("KV promise not shared", session=sid, error=str(exc) or type(exc).__name__)
            return True
        if out.stale_on and stale is not None:
            stale(out.stale_on, out.stale_secret)
        return out.made

    def _spawn(self, op, after: asyncio.Task | None = None) -> asyncio.Task:
        async def run() -> None:
            if after is not None:
                await asyncio.wait({after})
            try:
                await asyncio.wait_for(op, 2.0)
            except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
                log.warning("KV promise not shared", error=str(exc) or type(exc).__name__)
        return self._background.spawn(run())

    async def close(self) -> None:
        """Cancels and awaits the promise writes still in flight (at shutdown)."""
        await self._background.close()

    def _wake(self) -> None:
        head = self.book.head
        if head is not None:
            head.set()
