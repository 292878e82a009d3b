"""Which workers to fence: the pure part of the coordinator's liveness watch (time as an argument).

A worker is heard each time its liveness key's value changes (every heartbeat writes its time
there) or it registers anew (a new epoch). One not heard for ``fence_after`` seconds is due to be
fenced (docs/deploy.md "Faults"): it stopped answering, or died; either way the coordinator moves or
fails its sessions, and revokes its registration so that, should it resume, it learns it was fenced
out and registers clean.

The watcher's own gaps do not count against the workers: after a gap between two observations of
more than half the bound (the coordinator itself was stopped, or Redis was unreachable), every
worker counts as heard at the later one.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Liveness:
    fence_after: float
    heard: dict[str, float] = field(default_factory=dict)  # worker id -> when last heard
    beats: dict[str, bytes] = field(default_factory=dict)  # worker id -> its liveness value then
    epochs: dict[str, int] = field(default_factory=dict)  # worker id -> its registration's epoch
    observed_at: float | None = None

    def observe(self, epochs: dict[str, int], beats: dict[str, bytes], now: float) -> list[tuple[str, int]]:
        """The registered workers (id -> epoch) and the liveness values found at ``now``: the
        (worker id, epoch) of each registration due to be fenced, oldest silence first."""
        blind = self.observed_at is not None and now - self.observed_at > self.fence_after / 2
        self.observed_at = now
        for wid in [w for w in self.epochs if w not in epochs]:  # left, or fenced: forgotten
            self.forget(wid)
        due = []
        for wid, epoch in epochs.items():
            beat = beats.get(wid)
            if blind or self.epochs.get(wid) != epoch or (beat is not None and beat != self.beats.get(wid)):
                self.heard[wid] = now
            self.epochs[wid] = epoch
            if beat is not None:
                self.beats[wid] = beat
            if now - self.heard[wid] > self.fence_after:
                due.append((wid, epoch))
        due.sort(key=lambda d: self.heard[d[0]])
        return due

    def forget(self, worker_id: str) -> None:
        self.heard.pop(worker_id, None)
        self.beats.pop(worker_id, None)
        self.epochs.pop(worker_id, None)
