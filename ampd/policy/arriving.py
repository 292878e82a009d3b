"""Prefix blocks on their way to a decode worker: a session just bound there whose first prefill
(local or remote) is writing its prompt's blocks. A decode worker indexes, and publishes for binding
(``ampd.state.prefixes``), only blocks its prefill has written; a second session with the same
prefix that arrives during the first one's prefill would find no holder and be bound by admission
alone. Whoever made the first binding (the coordinator, the simulator) counts the blocks as arriving
on that worker until they land (its first token: the worker publishes within a moment), the round
fails, the session ends, or ``ARRIVING_TTL_S`` passes, so that ``rebind_prefix`` follows them as it
follows held blocks.

Only the binding follows them: a session whose round begins before the blocks are in its worker's
index prefills them itself (``PrefixIndex.share`` shares indexed blocks only), so an arriving count
never changes a token, only where a session goes.

Pure: time is an argument (the coordinator's ``time.monotonic()``, the simulator's clock).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .prefixbind import leading

__all__ = ["Arriving", "ARRIVING_TTL_S", "LANDED_GRACE_S", "with_arriving"]

# A prefill still running this long after its binding is not followed any more: a lost event must
# not keep pulling sessions to a worker for blocks that never come.
ARRIVING_TTL_S = 30.0
# After the first token the worker publishes its new blocks within its batch (50 ms,
# services/decode/prefixpub.py) plus a Redis write: counted until then.
LANDED_GRACE_S = 1.0


@dataclass
class _Entry:
    worker: str
    hashes: tuple[int, ...]
    until: float


class Arriving:
    """Session id -> the blocks its first prefill is writing on its worker (the hashes of its prompt's
    shareable blocks in that worker's block size and seed: ``prefix_hashes``), with a deadline."""

    def __init__(self, ttl_s: float = ARRIVING_TTL_S, grace_s: float = LANDED_GRACE_S) -> None:
        if ttl_s <= 0 or grace_s < 0:
            raise ValueError(f"ttl_s must be > 0 and grace_s >= 0, got {ttl_s}, {grace_s}")
        self.ttl_s, self.grace_s = ttl_s, grace_s
        self._entries: dict[str, _Entry] = {}
        self._on: dict[str, Counter] = {}  # worker -> hash -> arriving sessions writing it

    def __len__(self) -> int:
        return len(self._entries)

    def bound(self, session_id: str, worker: str, hashes: Sequence[int], now: float) -> None:
        """``session_id`` is bound to ``worker``, where its first prefill will write ``hashes``."""
        self.gone(session_id)
        if not hashes:
            return
        e = _Entry(worker, tuple(hashes), now + self.ttl_s)
        self._entries[session_id] = e
        self._on.setdefault(worker, Counter()).update(e.hashes)

    def landed(self, session_id: str, now: float) -> None:
        """Its first prefill is done (first token): counted only until the worker has published."""
        e = self._entries.get(session_id)
        if e is not None:
            e.until = min(e.until, now + self.grace_s)

    def gone(self, session_id: str) -> None:
        """Its round failed, it ended or moved: nothing is arriving for it."""
        e = self._entries.pop(session_id, None)
        if e is None:
            return
        on = self._on[e.worker]
        on.subtract(e.hashes)
        for h in e.hashes:
            if on[h] <= 0:
                del on[h]
        if not on:
            del self._on[e.worker]

    def expire(self, now: float) -> None:
        for sid in [s for s, e in self._entries.items() if e.until <= now]:
            self.gone(sid)

    def matches(self, hashes: Mapping[str, Sequence[int]], now: float) -> dict[str, int]:
        """worker id -> how many leading blocks of ``hashes[worker id]`` are arriving there (as
        ``PrefixSets.matches`` counts the held ones); workers with none are left out."""
        self.expire(now)
        out = {}
        for wid, hs in hashes.items():
            on = self._on.get(wid)
            if on and hs:
                n = leading(h in on for h in hs)
                if n:
                    out[wid] = n
        return out


def with_arriving(held: Mapping[str, int], arriving: Mapping[str, int]) -> dict[str, int]:
    """worker id -> leading blocks held or arriving there (the longer: both are leading runs of one
    chain of hashes)."""
    out = dict(held)
    for wid, n in arriving.items():
        out[wid] = max(out.get(wid, 0), n)
    return out
