"""Waiting for prefix blocks a decode worker is still writing (``--prefix-sharing``).

A session whose first round begins on a decode worker while another session's prefill (local or
remote) is writing blocks of the same prompt prefix there would prefill that prefix a second time:
the worker's index (``PrefixIndex``) shares only blocks already written. When the blocks are due
before its own prefill of them would be done, the round waits for them instead and then shares them: it is deferred until the writer's
first token (its blocks enter the index), the writer fails or ends, or the wait's bound passes (it
then prefills as it would have; the index shares what is there, so a wait never changes a token).

``Landing`` keeps, per worker, the sessions writing prompt blocks (their hashes and when their
prefill is expected to be done) and the rounds waiting on each; ``wait_until`` decides. The live
decode worker (``services/decode/prefixwait.py``) and the simulator (``ampd/sim/prefixing.py``) both
drive them, with the worker's cost model's prefill times. Pure: time is an argument.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefixbind import leading

__all__ = ["Landing", "Writer", "wait_until"]


def wait_until(now: float, lands_at: float, self_s: float, after_s: float,
               ttft_left_s: float | None = None) -> float | None:
    """Whether a round that would prefill its prompt in ``self_s`` from what is indexed now, and in
    ``after_s`` once blocks due at ``lands_at`` are there, waits for them, and until when: None (it
    prefills now), or the time past which it stops waiting and prefills (``now + self_s``).

    It waits when they are due before its own prefill of them would be done: its first token then
    comes at most ``after_s`` later than without waiting (the shared blocks' prefill is saved for the
    other rounds), sooner when they land early. ``ttft_left_s`` (its TTFT SLO less the time since its
    input was ready; None: no SLO): when prefilling itself meets the SLO, waiting must too (the bound
    leaves ``after_s`` before it)."""
    lands_in = max(lands_at - now, 0.0)
    if self_s <= after_s or lands_in >= self_s:
        return None
    wait_s = self_s
    if ttft_left_s is not None and self_s <= ttft_left_s:
        wait_s = min(wait_s, ttft_left_s - after_s)
        if lands_in >= wait_s:
            return None
    return now + wait_s


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
