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
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence

from ampd.policy import SLO, WorkerView
from ampd.policy.admit import KV_FULL, QUEUE_FULL, AdmissionCost, decide

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
    def __init__(self, wait_s: float, queue_max: int, rule: str = "kv", cost: AdmissionCost | None = None,
                 slo: SLO | None = None) -> None:
        if rule == "slo" and (cost is None or slo is None):
            raise ValueError("admission rule 'slo' needs the cost model and the SLO")
        self.wait_s = wait_s
        self.queue_max = queue_max
        self.rule, self.cost, self.slo = rule, cost, slo
        self.promised: Counter[str] = Counter()  # decode worker -> KV tokens promised to its live sessions
        self.sessions: Counter[str] = Counter()  # decode worker -> sessions admitted there, live
        self._waiters: deque[asyncio.Event] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, need: int, rooms: Rooms, l_incr: int = 0, since: float | None = None,
                    new: bool = True) -> str:
        """A decode worker for a session that may need ``need`` KV tokens, with ``need`` promised to
        it. ``l_incr``: its first prefill's tokens; ``since``: when it arrived (time.monotonic());
        ``new``: False for a session already accepted (moved, or bound again for a later turn),
        which only the KV rule applies to. Raises Refused, or LookupError when no decode worker serves."""
        start = time.monotonic() if since is None else since
        deadline = start + self.wait_s
        rule = self.rule if new else "kv"
        me: asyncio.Event | None = None
        try:
            while True:
                decode, prefill = await rooms()
                if not decode:
                    raise LookupError("no decode worker is serving")
                now = time.monotonic()
                # kv: first come, first served. slo: newest first; a new session goes ahead of the
                # waiting ones (it has the most TTFT budget left; under overload the oldest would
                # miss its TTFT anyway, and is refused when its budget is spent).
                ahead = bool(self._waiters) and self._waiters[0] is not me and not (self.rule == "slo"
                                                                                  and me is None)
                v = decide(rule, decode, prefill, self.promised, self.sessions, need, l_incr, now - start,
                           self.cost, self.slo)
                if v.reason:
                    raise Refused(v.reason, v.detail)
                if v.worker is not None and not ahead:
                    self.promised[v.worker] += need
                    self.sessions[v.worker] += 1
                    return v.worker
                if me is None:
                    if self.wait_s <= 0 or len(self._waiters) >= self.queue_max:
                        raise Refused(KV_FULL if self.wait_s <= 0 else QUEUE_FULL,
                                      f"no decode worker has KV for {need} tokens now, and "
                                      + ("admission does not wait" if self.wait_s <= 0 else
                                         f"{self.queue_max} sessions already wait"))
                    me = asyncio.Event()
                    if self.rule == "slo":
                        self._waiters.appendleft(me)
                    else:
                        self._waiters.append(me)
                left = deadline - now
                if left <= 0:
                    raise Refused(KV_FULL, f"no decode worker had KV for {need} tokens within {self.wait_s:g} s")
                me.clear()
                # Woken by a release (the head) or by the head leaving. Only the head also looks
                # again twice a second (a new worker may have joined): many waiters must not poll.
                # None waits past its TTFT budget (slo): it is judged again, and refused, then.
                head = self._waiters[0] is me
                try:
                    await asyncio.wait_for(me.wait(), min(left, v.wait_s, 0.5 if head else left))
                except asyncio.TimeoutError:
                    pass
        finally:
            if me is not None:
                head = self._waiters and self._waiters[0] is me
                self._waiters.remove(me)
                if head:
                    self._wake()

    def add(self, worker: str, tokens: int) -> None:
        """A later turn of an accepted session: it is not refused, but its KV is promised too."""
        self.promised[worker] += tokens

    def release(self, worker: str, tokens: int) -> None:
        """A session ended: its promise is free for the waiting ones."""
        self.promised[worker] -= tokens
        if self.promised[worker] <= 0:
            del self.promised[worker]
        self.sessions[worker] -= 1
        if self.sessions[worker] <= 0:
            del self.sessions[worker]
        self._wake()

    def _wake(self) -> None:
        if self._waiters:
            self._waiters[0].set()
