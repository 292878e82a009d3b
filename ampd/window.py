"""Windowed mean of recent samples (windowed TTFT on prefill workers, ITL on decode workers).

Pure: time is passed in, so the live workers and the simulator share it.
"""
from __future__ import annotations

from collections import deque

# The default window of the workers' windowed TTFT/ITL means, seconds: ampd.config's `stats_window`
# (--stats-window) takes it from here, and so do the cores built without one.
STATS_WINDOW_S = 10.0


class WindowedMean:
    """Mean of the samples added in the last `window_s` seconds; None when there are none."""

    __slots__ = ("window_s", "_samples", "_sum", "_count")

    def __init__(self, window_s: float = STATS_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float, int]] = deque()
        self._sum = 0.0
        self._count = 0

    def add(self, now: float, value: float, count: int = 1) -> None:
        """Adds `count` samples of `value` observed at `now` (times must not go backwards)."""
        total = value * count
        samples = self._samples
        samples.append((now, total, count))
        self._sum += total
        self._count += count
        horizon = now - self.window_s
        # _expire, inlined (add runs per decode run in the simulator); the sample just added stops
        # the loop (now >= horizon), so the window never empties here
        while samples[0][0] < horizon:
            _, total, count = samples.popleft()
            self._sum -= total
            self._count -= count

    def mean(self, now: float) -> float | None:
        """The mean of the samples within the window at `now`."""
        samples = self._samples
        if samples and samples[0][0] < now - self.window_s:
            self._expire(now)
        return self._sum / self._count if self._count else None

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        samples = self._samples
        while samples and samples[0][0] < horizon:
            _, total, count = samples.popleft()
            self._sum -= total
            self._count -= count
        if not samples:  # drop float drift
            self._sum, self._count = 0.0, 0
