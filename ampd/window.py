"""Windowed mean of recent samples (windowed TTFT on prefill workers, ITL on decode workers).

Pure: time is passed in, so the live workers and the simulator share it.
"""
from __future__ import annotations

# The default window of the workers' windowed TTFT/ITL means, seconds: ampd.config's `stats_window`
# (--stats-window) takes it from here, and so do the cores built without one.
STATS_WINDOW_S = 10.0


class WindowedMean:
    """Mean of the samples added in the last `window_s` seconds; None when there are none.

    The samples are parallel lists read from ``_head`` (the expired ones before it are cut off in
    bulk), not a deque of tuples: compiled, list reads and appends are native, a deque's methods
    Python-level calls, and no tuple is built per sample (``add`` runs per decode run in the
    simulator). The sums change in the same order as with a queue, so the floats are the same."""

    __slots__ = ("window_s", "_at", "_total", "_n", "_head", "_sum", "_count")

    def __init__(self, window_s: float = STATS_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._at: list[float] = []  # each sample's time, value * count and count, oldest first
        self._total: list[float] = []
        self._n: list[int] = []
        self._head = 0  # the oldest sample still in the window
        self._sum = 0.0
        self._count = 0

    def add(self, now: float, value: float, count: int = 1) -> None:
        """Adds `count` samples of `value` observed at `now` (times must not go backwards)."""
        total = value * count
        self._at.append(now)
        self._total.append(total)
        self._n.append(count)
        self._sum += total
        self._count += count
        if self._at[self._head] < now - self.window_s:  # the sample just added stays: never empties here
            self._expire(now)

    def mean(self, now: float) -> float | None:
        """The mean of the samples within the window at `now`."""
        at = self._at
        if self._head < len(at) and at[self._head] < now - self.window_s:
            self._expire(now)
        return self._sum / self._count if self._count else None

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        at, total, n = self._at, self._total, self._n
        h = self._head
        end = len(at)
        while h < end and at[h] < horizon:
            self._sum -= total[h]
            self._count -= n[h]
            h += 1
        if h == end:  # drop float drift
            self._sum, self._count = 0.0, 0
            at.clear()
            total.clear()
            n.clear()
            h = 0
        elif h >= 64 and 2 * h >= end:  # cut the expired ones off: amortised O(1) a sample
            del at[:h]
            del total[:h]
            del n[:h]
            h = 0
        self._head = h
