"""Admission of new sessions by decode KV: a session is accepted only when some decode worker has
the KV it may need, net of what is promised to the sessions in flight there (ampd.policy.bind);
otherwise it waits, first come first served, up to ``admission_wait`` seconds in a queue of at most
``admission_queue`` sessions, and is then refused (RESOURCE_EXHAUSTED). A session accepted is never
aborted for lack of KV: its promise is released only when it ends."""
from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable

from ampd.policy import WorkerView, bind

__all__ = ["Admission", "Refused"]


class Refused(Exception):
    """No KV for the session (RESOURCE_EXHAUSTED); the message says why."""


class Admission:
    def __init__(self, wait_s: float, queue_max: int) -> None:
        self.wait_s = wait_s
        self.queue_max = queue_max
        self.promised: Counter[str] = Counter()  # decode worker -> KV tokens promised to its live sessions
        self._waiters: deque[asyncio.Event] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, need: int, rooms: Callable[[], Awaitable[list[WorkerView]]]) -> str:
        """A decode worker for a session that may need ``need`` KV tokens, with ``need`` promised to
        it. ``rooms()``: the live decode workers, ``kv_free_tokens`` being each one's capacity.
        Raises Refused, or LookupError when no decode worker serves."""
        deadline = time.monotonic() + self.wait_s
        me: asyncio.Event | None = None
        try:
            while True:
                workers = await rooms()
                if not workers:
                    raise LookupError("no decode worker is serving")
                biggest = max(w.kv_free_tokens for w in workers)
                if need > biggest:
                    raise Refused(f"the session may need {need} KV tokens, more than any decode worker holds "
                                  f"({biggest})")
                if not self._waiters or self._waiters[0] is me:  # first come, first served
                    chosen = bind(workers, self.promised, need)
                    if chosen is not None:
                        self.promised[chosen] += need
                        return chosen
                if me is None:
                    if self.wait_s <= 0 or len(self._waiters) >= self.queue_max:
                        raise Refused(f"no decode worker has KV for {need} tokens now, and "
                                      + ("admission does not wait" if self.wait_s <= 0 else
                                         f"{self.queue_max} sessions already wait"))
                    me = asyncio.Event()
                    self._waiters.append(me)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refused(f"no decode worker had KV for {need} tokens within {self.wait_s:g} s")
                me.clear()
                # Woken by a release (the head) or by the head leaving. Only the head also looks
                # again twice a second (a new worker may have joined): many waiters must not poll.
                head = self._waiters[0] is me
                try:
                    await asyncio.wait_for(me.wait(), min(left, 0.5) if head else left)
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
        self._wake()

    def _wake(self) -> None:
        if self._waiters:
            self._waiters[0].set()
