"""Admission of new sessions (the rule is ampd.policy.admit's, ``--admission``): a session is accepted
only when some decode worker has the KV it may need, net of what is promised to the sessions in
flight there, and, under the ``slo`` rule, when it can still meet its TTFT and ITL SLO there;
otherwise it waits, first come first served, up to ``admission_wait`` seconds (``slo``: no longer than
its TTFT budget lasts) in a queue of at most ``admission_queue`` sessions, or is refused
(RESOURCE_EXHAUSTED, with the reason). A session accepted is never aborted for lack of KV: its
promise is released only when it ends."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from ampd.policy import SLO, WorkerView
from ampd.policy.admit import AdmissionBook, AdmissionCost

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

    def __init__(self, wait_s: float, queue_max: int, rule: str = "kv", cost: AdmissionCost | None = None,
                 slo: SLO | None = None) -> None:
        self.book = AdmissionBook(rule, wait_s, queue_max, cost, slo)
        self.promised = self.book.promised  # decode worker -> KV tokens promised to its live sessions
        self.sessions = self.book.sessions  # decode worker -> sessions admitted there, live

    @property
    def waiting(self) -> int:
        return len(self.book.waiting)

    async def admit(self, need: int, rooms: Rooms, l_incr: int = 0, since: float | None = None,
                    new: bool = True) -> str:
        """A decode worker for a session that may need ``need`` KV tokens, with ``need`` promised to
        it. ``l_incr``: its first prefill's tokens; ``since``: when it arrived (time.monotonic());
        ``new``: False for a session already accepted (moved, or bound again for a later turn),
        which only the KV rule applies to. Raises Refused, or LookupError when no decode worker serves."""
        start = time.monotonic() if since is None else since
        book = self.book
        me = asyncio.Event()
        try:
            while True:
                decode, prefill = await rooms()
                if not decode:
                    raise LookupError("no decode worker is serving")
                v = book.judge(me, need, l_incr, time.monotonic() - start, decode, prefill, new)
                if v.reason:
                    raise Refused(v.reason, v.detail)
                if v.worker is not None:
                    return v.worker
                me.clear()
                # Woken by a release (the head) or by the head leaving. Only the head also looks
                # again twice a second (a new worker may have joined): many waiters must not poll.
                # None waits past its admission wait or its TTFT budget (slo): judged again, refused.
                try:
                    await asyncio.wait_for(me.wait(), min(v.wait_s, 0.5) if book.head is me else v.wait_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            if book.leave(me):
                self._wake()

    def add(self, worker: str, tokens: int) -> None:
        """A later turn of an accepted session: it is not refused, but its KV is promised too."""
        self.book.add(worker, tokens)

    def release(self, worker: str, tokens: int) -> None:
        """A session ended: its promise is free for the waiting ones."""
        self.book.release(worker, tokens)
        self._wake()

    def _wake(self) -> None:
        head = self.book.head
        if head is not None:
            head.set()
