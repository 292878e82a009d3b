"""Tool-aware KV tier policy: when a round ends in a tool call, keep the session's KV on the device,
offload it to the host pool, or drop it; and when to bring it back.

Pure: no I/O, no clock; times are passed in (wall clock live, virtual clock in the simulator). The
decode core owns each session's ``KVState`` and asks these functions; the driver moves the bytes.

Units: ``blocks`` are the device pool's blocks (the host pool uses the same block size); every
``*_s`` is seconds. Transfer times come from the performance profile (``host_transfer_s``).

Hints: an agent's expected tool duration (``Turn.hints``, a trace round's ``hints``), clamped to [0,
``max_hint_s``], replaces the windowed estimate in ``decide`` where that holds no more room
(``decide_hinted``). A wrong hint cannot take another session's room, because of four rules stated
here and tested:

- ``decide_hinted`` takes the hint's decision only when it holds no more room than the estimate's
  (drop < offload < keep), and plans a prefetch by the later of the hinted and estimated ends (none
  without an estimate): a short or hostile hint neither keeps KV on the device nor brings it back
  sooner than the same call without the hint;

- the decode core's eviction does not read hints, so a short hint cannot shield its KV (see
  "Eviction order" below);
- a speculative prefetch (before the result arrived) only takes blocks nobody is waiting for
  (``should_prefetch``), and KV brought back early is idle, so it is evictable again;
- kept KV is evictable.
So a lying hint moves its own session's KV at the wrong time: it costs that session a transfer or a
re-prefill. (A long hint offloads its KV at once; the host room it holds is freed when the result
arrives and the KV comes back, as with a long windowed estimate.)

Eviction order: under pressure the decode core (``ampd.worker.decode_tier``,
``TierMixin._tier_make_room``) takes idle KV least recently used first (the tool call that began
longest ago): to the host while it has room, else dropped. Every idle session is in that order,
whatever its hint, so a pool full of idle sessions always makes room (never a deadlock). Ranking
by the tool's expected end instead (unknown ends first, then the session expected back last first,
a hint pushing only its own session forward) admitted fewer sessions and met the SLO for fewer on
benchmarks.kv_tier (benchmarks/results/kv_evict_order.json, docs/kv.md); the likely cause, not
measured apart: a tool's windowed mean says little about when one call of it ends.
"""
from __future__ import annotations

from typing import Final
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .cost import kv_s
from .types import CostModel

__all__ = ["KVState", "KEEP", "OFFLOAD", "DROP", "KVTierConfig", "ToolPause", "PoolState", "TierDecision",
           "Prefetch", "decide", "decide_hinted", "prefetch_plan", "should_prefetch", "effective_tool_s",
           "host_transfer_s", "transfer_fn"]


class KVState(enum.Enum):
    """Where a session's KV is: on the device pool, only in the host pool, or nowhere (its next
    round prefills the whole history again)."""

    RESIDENT = "resident"
    HOST = "host"
    GONE = "gone"


KEEP: Final = "keep"
OFFLOAD: Final = "offload"
DROP: Final = "drop"


@dataclass(slots=True)
class KVTierConfig:
    """The policy's knobs (defaults here; the flags that set them live in the settings).

    ``offload_pressure``: the device pool's use, (used + waiting) / capacity, below which idle KV
    stays: with room to spare, moving KV buys nothing. ``margin_s``: a prefetch starts this long
    before the expected end beyond its transfer time, and a tool must outlast the round trip by it
    to be worth an offload. ``max_hint_s``: the longest tool duration a hint may claim (the API's
    limit on a tool's latency)."""

    offload_pressure: float = 0.7
    margin_s: float = 0.05
    max_hint_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.offload_pressure <= 1.0:
            raise ValueError(f"offload_pressure must be in [0, 1], got {self.offload_pressure}")
        if not (math.isfinite(self.margin_s) and self.margin_s >= 0):
            raise ValueError(f"margin_s must be a finite number >= 0, got {self.margin_s}")
        if not self.max_hint_s > 0:
            raise ValueError(f"max_hint_s must be > 0, got {self.max_hint_s}")


@dataclass(slots=True, init=False)
class ToolPause:
    """A session whose round just ended in a tool call. ``expected_s``: the tool's expected duration
    (``effective_tool_s``; None: never observed, no hint). ``offload_s`` / ``prefetch_s``: moving its
    KV to the host and back; ``reprefill_s``: prefilling its whole history again."""

    session_id: str
    tool: str
    expected_s: float | None
    kv_blocks: int
    offload_s: float
    prefetch_s: float
    reprefill_s: float

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, session_id: str, tool: str, expected_s: float | None, kv_blocks: int, offload_s: float,
                 prefetch_s: float, reprefill_s: float) -> None:
        self.session_id = session_id
        self.tool = tool
        self.expected_s = expected_s
        self.kv_blocks = kv_blocks
        self.offload_s = offload_s
        self.prefetch_s = prefetch_s
        self.reprefill_s = reprefill_s


@dataclass(slots=True, init=False)
class PoolState:
    """The worker's pools in blocks: the device pool's capacity and use, what rounds waiting for KV
    need, and the host pool's free blocks (0 when the host tier is off)."""

    device_blocks: int
    device_used: int
    waiting: int = 0
    host_free: int = 0

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, device_blocks: int, device_used: int, waiting: int = 0, host_free: int = 0) -> None:
        self.device_blocks = device_blocks
        self.device_used = device_used
        self.waiting = waiting
        self.host_free = host_free

    @property
    def pressure(self) -> float:
        return (self.device_used + self.waiting) / self.device_blocks if self.device_blocks > 0 else 1.0

    @property
    def spare(self) -> int:
        """Device blocks free that no waiting round needs."""
        return self.device_blocks - self.device_used - self.waiting


@dataclass(slots=True, init=False)
class TierDecision:
    """KEEP, OFFLOAD or DROP, why (a reason string for logs and metrics), and the numbers compared."""

    action: str
    reason: str
    estimates: dict[str, float] = field(default_factory=dict)

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, action: str, reason: str, estimates: dict[str, float] | None = None) -> None:
        self.action = action
        self.reason = reason
        self.estimates = {} if estimates is None else estimates


def effective_tool_s(estimate_s: float | None, hint_s: float | None, cfg: KVTierConfig) -> float | None:
    """The hint when given (clamped to [0, max_hint_s]; a non-finite one is ignored), else the
    windowed estimate."""
    if hint_s is not None and not math.isnan(hint_s):
        return clamp_hint(hint_s, cfg)
    return estimate_s


def clamp_hint(hint_s: float, cfg: KVTierConfig) -> float:
    """A finite hint, clamped to [0, max_hint_s]."""
    return min(max(hint_s, 0.0), cfg.max_hint_s)


def decide(p: ToolPause, pool: PoolState, cfg: KVTierConfig) -> TierDecision:
    """Keep, offload or drop the KV of a session entering a tool call. In order:

    1. no KV, or the device pool under ``offload_pressure``: keep (``no-kv``, ``no-pressure``);
    2. unknown duration: offload when the host has room (it is undone by a prefetch), else keep and
       leave it to the eviction order (``unknown-tool``, ``unknown-tool-host-full``);
    3. a tool shorter than offload + prefetch + margin: keep, moving would delay its next round
       (``short-tool``);
    4. re-prefilling the history is no slower than fetching it back: drop (``reprefill-cheaper``);
    5. the host has room: offload (``long-tool``);
    6. host full: drop when rounds wait for device blocks (``host-full-demand``), else keep
       (``host-full``; still evictable)."""
    est = {"pressure": pool.pressure, "kv_blocks": float(p.kv_blocks), "host_free": float(pool.host_free),
           "offload_s": p.offload_s, "prefetch_s": p.prefetch_s, "reprefill_s": p.reprefill_s}
    if p.expected_s is not None:
        est["expected_s"] = p.expected_s
    if p.kv_blocks <= 0:
        return TierDecision(KEEP, "no-kv", est)
    if pool.pressure < cfg.offload_pressure:
        return TierDecision(KEEP, "no-pressure", est)
    host_fits = pool.host_free >= p.kv_blocks
    if p.expected_s is None:
        return TierDecision(OFFLOAD, "unknown-tool", est) if host_fits else \
            TierDecision(KEEP, "unknown-tool-host-full", est)
    round_trip = p.offload_s + p.prefetch_s + cfg.margin_s
    est["round_trip_s"] = round_trip
    if p.expected_s < round_trip:
        return TierDecision(KEEP, "short-tool", est)
    if p.reprefill_s <= p.prefetch_s:
        return TierDecision(DROP, "reprefill-cheaper", est)
    if host_fits:
        return TierDecision(OFFLOAD, "long-tool", est)
    if pool.waiting > 0:
        return TierDecision(DROP, "host-full-demand", est)
    return TierDecision(KEEP, "host-full", est)


# How much room another round may need each action leaves the session's KV holding: a drop none, an
# offload the host pool's, a keep the device pool's (evictable, but a round that needs it waits for
# its move). ``decide_hinted`` takes a hint's action only when it holds no more than the estimate's.
_HOLDS = {DROP: 0, OFFLOAD: 1, KEEP: 2}


def decide_hinted(p: ToolPause, hint_s: float | None, pool: PoolState,
                  cfg: KVTierConfig) -> tuple[TierDecision, float | None]:
    """``decide`` with the agent's expected tool duration ``hint_s`` (None: no hint) for ``p``, whose
    ``expected_s`` is the tool's windowed estimate; and the duration a prefetch is planned by (None:
    the KV comes back when the result arrives).

    The decision for the hint (clamped: ``effective_tool_s``) is taken when it holds no more room
    than the decision for the estimate (``_HOLDS``: drop < offload < keep): a hint can move its own
    KV off the device sooner, never keep it there where the estimate would move it (a short hint on
    a tool that is in fact long, or on one never observed, would hold device room another round then
    waits to evict). The prefetch is planned by the later of the hinted and the estimated end, and
    not at all without an estimate: a hint can delay its own prefetch, never bring idle KV back
    sooner than without it. No hint: ``decide`` and the estimate, exactly."""
    base = decide(p, pool, cfg)
    if hint_s is None or math.isnan(hint_s):
        return base, p.expected_s
    h = clamp_hint(hint_s, cfg)
    hinted = decide(replace(p, expected_s=h), pool, cfg)
    d = hinted if _HOLDS[hinted.action] <= _HOLDS[base.action] else base
    d.estimates["hint_s"] = h
    return d, None if p.expected_s is None else max(p.expected_s, h)


@dataclass(slots=True)
class Prefetch:
    """When to start bringing offloaded KV back: ``at`` (None: when the result arrives)."""

    at: float | None
    reason: str


def prefetch_plan(tool_start: float, expected_s: float | None, prefetch_s: float, cfg: KVTierConfig) -> Prefetch:
    """Start at the expected end minus the transfer minus the margin (not before the tool started):
    ``expected-end``; with no expected duration, wait for the result: ``on-result``."""
    if expected_s is None:
        return Prefetch(None, "on-result")
    return Prefetch(max(tool_start, tool_start + expected_s - prefetch_s - cfg.margin_s), "expected-end")


def should_prefetch(now: float, plan: Prefetch, result_ready: bool, kv_blocks: int, pool: PoolState) -> str:
    """The reason to start the prefetch now, or "" to wait. A ready result starts it at once
    (``result-arrived``: it then goes through KV admission like any round). Before the result, it
    starts at ``plan.at`` only into blocks no waiting round needs (``expected-end``): a speculative
    prefetch never takes room from another session."""
    if result_ready:
        return "result-arrived"
    if plan.at is None or now < plan.at or pool.spare < kv_blocks:
        return ""
    return "expected-end"


def host_transfer_s(cost: CostModel, tokens: int, tp: int) -> float:
    """Seconds to move ``tokens`` tokens of KV between a ``tp`` worker's device pool and its host
    pool, either way. The profile has no host-link term yet; the KV transport moves host copies
    over the same NIXL path as worker-to-worker copies, so its ``t_kv`` at (tp, tp) is used."""
    return kv_s(cost, tokens, tp, tp) if tokens > 0 else 0.0


def transfer_fn(cost: CostModel, tp: int, block_tokens: int) -> Callable[[int], float]:
    """``host_transfer_s`` for a block count."""
    return lambda blocks: host_transfer_s(cost, blocks * block_tokens, tp)
