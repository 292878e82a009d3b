"""The share of admitted KV that can be off the device: how much of a host KV tier admission may
promise (``ampd.policy.admit.promise_room``).

A session's KV can sit in the host pool only while the session is idle in a tool call long enough to
be worth moving (the tier policy, ``ampd.policy.kvtier.decide``: longer than the move out and back),
and then only between the end of the offload and the start of the prefetch. While a round runs, or
waits to run, its KV is on the device. So of the KV the admitted sessions hold, about the share of
its token-seconds spent in such calls can be on host at once; the rest needs the device. This module
keeps that share as a windowed estimate over the rounds and tool calls that ended lately, each
weighted by the session's KV tokens at the time (late rounds hold more KV than early ones).

Both drivers feed it the same samples: the coordinator from its sessions' ``RoundTiming``
(services/coordinator/session.py), the simulator from its rounds (``ampd.sim.loop``). Pure: time is
passed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .kvtier import KVTierConfig, host_transfer_s
from .types import CostModel

__all__ = ["OffDeviceShare", "OffDeviceShareConfig", "off_device_s"]

_MARGIN_S = KVTierConfig().margin_s  # the tier's (both drivers build it with the default margin)


@dataclass(slots=True)
class OffDeviceShareConfig:
    """``window_s``: how far back the estimate looks (the per-tool durations' window,
    ``ampd.policy.tooldur``: tool calls are rare next to decode steps). ``min_tools``: the tool calls
    the window must hold before the estimate counts; fewer and there is no estimate (admission then
    promises the device only)."""

    window_s: float = 300.0
    min_tools: int = 4

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.min_tools < 1:
            raise ValueError(f"min_tools must be >= 1, got {self.min_tools}")


def off_device_s(idle_s: float, round_trip_s: float, margin_s: float) -> float:
    """Of a tool call of ``idle_s`` seconds, how long its session's KV can be off the device: none
    when the call is not longer than the move out and back (``round_trip_s``) plus ``margin_s`` (the
    tier keeps such KV: ``kvtier.decide``'s ``short-tool``), else all but the moves (the KV holds its
    device blocks until the offload has copied it, and again from the prefetch's start)."""
    if not idle_s > round_trip_s + margin_s:
        return 0.0
    return idle_s - round_trip_s


class OffDeviceShare:
    """Windowed share of KV token-seconds spent idle in tool calls, off the device
    (``off_device_s``), among all the KV token-seconds of rounds and tool calls observed."""

    # (the samples are parallel lists read from ``_head``, as ``ampd.window.WindowedMean``'s and
    # for its reasons: compiled, native list reads, no tuple a sample)
    __slots__ = ("cfg", "_at", "_s_total", "_s_off", "_s_tools", "_head", "_total", "_off", "_tools")

    def __init__(self, cfg: OffDeviceShareConfig | None = None) -> None:
        self.cfg = cfg or OffDeviceShareConfig()
        self._at: list[float] = []  # each sample's time, KV token-s, of them off, tool calls; oldest first
        self._s_total: list[float] = []
        self._s_off: list[float] = []
        self._s_tools: list[int] = []
        self._head = 0  # the oldest sample still in the window
        self._total = self._off = 0.0
        self._tools = 0

    def round(self, now: float, kv_tokens: int, busy_s: float) -> None:
        """A round ended at ``now``: from its input being ready to its last token it took ``busy_s``
        seconds (waiting for KV, its prefill and its decode), its session holding ``kv_tokens`` at
        its end. Its KV was on the device (or on its way there) throughout."""
        if math.isfinite(busy_s) and busy_s >= 0 and kv_tokens > 0:
            self._add(now, kv_tokens * busy_s, 0.0, 0)

    def tool(self, now: float, kv_tokens: int, idle_s: float, off_s: float) -> None:
        """A tool call ended at ``now`` after ``idle_s`` seconds, its session holding ``kv_tokens``;
        ``off_s`` of it (``off_device_s``) the KV could be off the device."""
        if math.isfinite(idle_s) and idle_s >= 0 and kv_tokens > 0:
            self._add(now, kv_tokens * idle_s, kv_tokens * min(max(off_s, 0.0), idle_s), 1)

    def round_ended(self, ready: float, last: float, kv_tokens: int, tool_from: float | None, tool_kv: int,
                    cost: CostModel, tp: int) -> None:
        """What the drivers observe: a round whose input was ready at ``ready`` made its last token at
        ``last``, its session then holding ``kv_tokens``. ``tool_from``: when the tool call before it
        began (the previous round's last token; None for a session's first round), its session then
        holding ``tool_kv`` on a decode worker of degree ``tp``, whose move to the host and back the
        tier times with ``cost`` (``kvtier.host_transfer_s``)."""
        if tool_from is not None:
            idle = ready - tool_from
            self.tool(ready, tool_kv, idle, off_device_s(idle, 2 * host_transfer_s(cost, tool_kv, tp), _MARGIN_S))
        self.round(last, kv_tokens, last - ready)

    def share(self, now: float) -> float | None:
        """The share in [0, 1] at ``now``; None when the window holds fewer than ``min_tools`` tool
        calls or no KV time."""
        self._expire(now)
        if self._tools < self.cfg.min_tools or self._total <= 0:
            return None
        return min(max(self._off / self._total, 0.0), 1.0)

    def _add(self, now: float, total: float, off: float, tools: int) -> None:
        self._at.append(now)
        self._s_total.append(total)
        self._s_off.append(off)
        self._s_tools.append(tools)
        self._total += total
        self._off += off
        self._tools += tools
        self._expire(now)

    def _expire(self, now: float) -> None:
        horizon = now - self.cfg.window_s
        at, total, off, tools = self._at, self._s_total, self._s_off, self._s_tools
        h = self._head
        end = len(at)
        while h < end and at[h] < horizon:
            self._total -= total[h]
            self._off -= off[h]
            self._tools -= tools[h]
            h += 1
        if h == end:  # drop float drift
            self._total = self._off = 0.0
            for xs in (at, total, off):
                xs.clear()
            tools.clear()
            h = 0
        elif h >= 64 and 2 * h >= end:  # cut the expired ones off: amortised O(1) a sample
            for xs in (at, total, off):
                del xs[:h]
            del tools[:h]
            h = 0
        self._head = h
