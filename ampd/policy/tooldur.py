"""Per-tool windowed duration estimates: how long a named tool's calls took lately.

The sidecar (or, in the simulator, the driver) adds one sample per finished tool call; the KV tier
policy (``ampd.policy.kvtier``) reads the estimate when a round ends in a call to that tool. Pure:
time is passed in.
"""
from __future__ import annotations

from typing import Final
import math
from collections import OrderedDict
from dataclasses import dataclass

from ampd.window import WindowedMean

__all__ = ["ToolDurations", "ToolDurationsConfig", "REPLAY"]

REPLAY: Final = "replay"  # the name an unnamed (built-in replay) tool is counted under


@dataclass(slots=True)
class ToolDurationsConfig:
    """``window_s``: how far back the windowed mean looks. Tool calls are rare next to decode steps
    (one per round), so the window is minutes, not the ITL window's seconds. ``max_tools``: how many
    tool names are tracked; a client-side call names any tool it likes, so the table is bounded and
    the least recently seen name goes first."""

    window_s: float = 300.0
    max_tools: int = 256


class ToolDurations:
    """Windowed mean duration per tool name. When a tool's window is empty (no call in the last
    ``window_s``) its last observed duration is used: an old observation beats none."""

    __slots__ = ("cfg", "_tools")

    def __init__(self, cfg: ToolDurationsConfig | None = None) -> None:
        self.cfg = cfg or ToolDurationsConfig()
        if self.cfg.max_tools < 1:
            raise ValueError(f"max_tools must be >= 1, got {self.cfg.max_tools}")
        # name -> (its window, its last observed duration); most recently observed last
        self._tools: OrderedDict[str, tuple[WindowedMean, list[float]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tools)

    def observe(self, tool: str, now: float, duration_s: float) -> None:
        """A call to ``tool`` that took ``duration_s`` seconds ended at ``now``. Negative or
        non-finite durations (a clock step) are ignored."""
        if not (math.isfinite(duration_s) and duration_s >= 0):
            return
        name = tool or REPLAY
        entry = self._tools.get(name)
        if entry is None:
            entry = (WindowedMean(self.cfg.window_s), [duration_s])
            self._tools[name] = entry
            if len(self._tools) > self.cfg.max_tools:
                self._tools.popitem(last=False)
        else:
            self._tools.move_to_end(name)
            entry[1][0] = duration_s
        entry[0].add(now, duration_s)

    def expected_s(self, tool: str, now: float) -> float | None:
        """The expected duration of a call to ``tool`` starting at ``now``; None when it was never
        observed (or was dropped from the table)."""
        entry = self._tools.get(tool or REPLAY)
        if entry is None:
            return None
        mean = entry[0].mean(now)
        return entry[1][0] if mean is None else mean
