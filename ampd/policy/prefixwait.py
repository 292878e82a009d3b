"""Waiting for prefix blocks a decode worker is still writing (``--prefix-sharing``).

A session whose first round begins on a decode worker while another session's prefill (local or
remote) is writing blocks of the same prompt prefix there would prefill that prefix a second time:
the worker's index (``PrefixIndex``) shares only blocks already written. When the blocks are due
soon enough (``wait_until``: before a bound that keeps what a late writer costs small, and within the
round's TTFT SLO), the round waits for them instead and then shares them: it is deferred until the
writer's first token (its blocks enter the index), the writer fails or ends, or the wait's bound
passes (it then prefills as it would have; the index shares what is there, so a wait never changes
a token).

``Landing`` keeps, per worker, the sessions writing prompt blocks (their hashes and when their
prefill is expected to be done) and the rounds waiting on each; ``wait_until`` decides. The live
decode worker (``services/decode/prefixwait.py``) and the simulator (``ampd/sim/prefixing.py``) both
drive them, with the worker's cost model's prefill times. Pure: time is an argument.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefixbind import leading

__all__ = ["LATE_SHARE", "Landing", "Writer", "wait_until"]


LATE_SHARE = 0.5  # the most a late writer may add to a round's first token, as a share of its own prefill


def wait_until(now: float, lands_at: float, self_s: float, after_s: float,
               ttft_left_s: float | None = None) -> float | None:
    """Whether a round that would prefill its prompt in ``self_s`` from what is indexed now, and in
    ``after_s`` once blocks due at ``lands_at`` are there, waits for them, and until when: None (it
    prefills now), or the time past which it stops waiting and prefills all of it itself.

    A writer is often late (its due time is set as its round begins, before any KV or queue wait),
    so the bound is what a late one costs: at most ``LATE_SHARE`` of its own prefill's time, and,
    when prefilling itself meets its TTFT SLO (``ttft_left_s``: the SLO less the time since its
    input was ready; None: no SLO), no later than leaves that prefill room before the SLO. It waits
    only when the blocks are due before the bound: on time, its first token comes at most
    ``LATE_SHARE * self_s + after_s`` after now (sooner when they land early) and the shared blocks'
    prefill is saved for the other rounds; late, at most ``bound + self_s``."""
    if self_s <= after_s:
        return None
    bound_s = LATE_SHARE * self_s
    if ttft_left_s is not None and self_s <= ttft_left_s:
        bound_s = min(bound_s, ttft_left_s - self_s)
    if max(lands_at - now, 0.0) >= bound_s:
        return None
    return now + bound_s


@dataclass
class Writer:
    hashes: tuple[int, ...]
    lands_at: float
    waiters: list[str] = field(default_factory=list)


class Landing:
    """One decode worker's sessions writing prompt blocks (session id -> ``Writer``) and the rounds
    waiting for them (waiter id -> writer id)."""

    def __init__(self) -> None:
        self.writers: dict[str, Writer] = {}
        self.waiting: dict[str, str] = {}

    def writing(self, session_id: str, hashes: Sequence[int], lands_at: float) -> None:
        """``session_id``'s prefill, expected done at ``lands_at``, writes the blocks ``hashes``."""
        if hashes:
            old = self.writers.get(session_id)
            self.writers[session_id] = Writer(tuple(hashes), lands_at, old.waiters if old else [])

    def longest(self, hashes: Sequence[int]) -> tuple[str, int, float] | None:
        """(writer id, leading blocks of ``hashes`` it writes, when they land) of the writer of the
        most, the earliest on a tie; None when no writer has any."""
        best = None
        for sid, w in self.writers.items():
            n = leading(a == b for a, b in zip(hashes, w.hashes))
            if n and (best is None or (n, -w.lands_at) > (best[1], -best[2])):
                best = (sid, n, w.lands_at)
        return best

    def wait(self, waiter: str, writer: str) -> None:
        self.waiting[waiter] = writer
        self.writers[writer].waiters.append(waiter)

    def done(self, session_id: str) -> list[str]:
        """``session_id`` stops writing (its blocks landed, it failed or ended): the rounds that
        waited for it, to retry now; and it stops waiting, if it was."""
        self.gone(session_id)
        w = self.writers.pop(session_id, None)
        if w is None:
            return []
        for sid in w.waiters:
            self.waiting.pop(sid, None)
        return w.waiters

    def gone(self, waiter: str) -> bool:
        """``waiter`` stops waiting (its bound passed, it was cancelled): True if it was waiting."""
        writer = self.waiting.pop(waiter, None)
        if writer is None:
            return False
        self.writers[writer].waiters.remove(waiter)
        return True

    def empty(self) -> bool:
        return not self.writers and not self.waiting
