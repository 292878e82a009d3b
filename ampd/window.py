"""Windowed mean of recent samples (windowed TTFT on prefill workers, ITL on decode workers).

Pure: time is passed in, so the live workers and the simulator share it.
"""
from __future__ import annotations

import math
from collections import deque

# The default window of the workers' windowed TTFT/ITL means, seconds: ampd.config's `stats_window`
# (--stats-window) takes it from here, and so do the cores built without one.
STATS_WINDOW_S = 10.0


class WindowedMean:
    """Mean of the samples added in the last `window_s` seconds; None when there are none.

    ``mean`` is cached: the last mean holds while no sample was added and the oldest sample has not
    expired (a worker's view reads it per routing decision; the cache keeps a paper-scale
    simulation ~10 % faster than recomputing it)."""

    __slots__ = ("window_s", "_samples", "_sum", "_count", "_fresh", "_oldest", "_mean")

    def __init__(self, window_s: float = STATS_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float, int]] = deque()
        self._sum = 0.0
        self._count = 0
        self._fresh = False  # _mean is the mean as of the last read, and no sample came since
        self._oldest = math.inf  # time of the oldest sample at the last read
        self._mean: float | None = None

    def add(self, now: float, value: float, count: int = 1) -> None:
        """Adds `count` samples of `value` observed at `now` (times must not go backwards)."""
        total = value * count
        samples = self._samples
        samples.append((now, total, count))
        self._sum += total
        self._count += count
        self._fresh = False
        if samples[0][0] < now - self.window_s:  # inline check: add runs per decode run in the simulator
            self._expire(now)

    def mean(self, now: float) -> float | None:
        """The mean of the samples within the window at `now` (cached while nothing changed)."""
        horizon = now - self.window_s
        if self._fresh and self._oldest >= horizon:
            return self._mean
        samples = self._samples
        if samples and samples[0][0] < horizon:
            self._expire(now)
        mean = self._sum / self._count if self._count else None
        self._oldest = samples[0][0] if samples else math.inf
        self._fresh = True
        self._mean = mean
        return mean

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        samples = self._samples
        while samples and samples[0][0] < horizon:
            _, total, count = samples.popleft()
            self._sum -= total
            self._count -= count
        if not samples:  # drop float drift
            self._sum, self._count = 0.0, 0
