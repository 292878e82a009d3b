"""Agent hints (``Turn.hints``, the OpenAI front's ``ampd_hints`` body field) turned into the values
routing, admission, the queue order and the KV tier policy use, with the windowed estimates as the
fallback when a hint is absent.

A hint is advice from the client, and the client may be wrong or hostile. Each value is bounded so a
hint can only cost its own session:

- ``priority``: only a yield counts. A negative priority enqueues the turn's prefill as if it arrived
  ``-priority * yield_s`` later; a positive one counts as 0. Queues order by arrival, so a hint can
  push its own task back, never another's.
- ``expected_output_tokens``: decisions shared with other sessions (routing's decode estimate,
  KV admission) take the *larger* of the hint and the windowed estimate, capped by the round's
  ``max_tokens``: over-claiming makes its own round look costlier (it may wait or be placed
  elsewhere); under-claiming cannot make it look cheaper than without the hint.
- ``expected_tool_s``: the KV tier policy uses it as given (clamped to [0, max_hint_s]) to keep,
  offload or prefetch the session's own KV; the eviction order ranks the session by the later of
  hint and estimate (``kvtier.rank_end``), so a short hint cannot shield its KV from eviction.
Correctness never depends on a hint: they move time, not tokens.

Pure: no I/O, no clock. ``ampd.agenthints`` reads hints off the wire.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .kvtier import KVTierConfig, effective_tool_s, rank_end

__all__ = ["Hints", "HintConfig", "HintedValues", "shared_output_tokens", "queue_enqueued_at", "resolve",
           "hints_from_obj", "HINT_KEYS"]

HINT_KEYS = ("priority", "expected_output_tokens", "expected_tool_s")
# The session API's ranges (ampd.validate: MAX_PRIORITY, MAX_OUTPUT_TOKENS, MAX_TOOL_LATENCY_S; a unit
# test holds them equal): a pure core may not import the wire's module.
_MAX_PRIORITY, _MAX_OUTPUT, _MAX_TOOL_S = 100, 1 << 20, 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Hints:
    """A turn's hints; None (priority: 0) when absent. A value (frozen): a trace's rounds hold them."""

    priority: int = 0
    expected_output_tokens: int | None = None
    expected_tool_s: float | None = None


def check_hint_values(priority: object, expected_output_tokens: object, expected_tool_s: object, field: str) -> None:
    """The one rule for hint values (the session API, the OpenAI body, a trace round), each None
    when absent; raises ValueError naming the bad one by its path (``FIELD.priority: ...``)."""
    for name, v, lo, hi in (("priority", priority, -_MAX_PRIORITY, _MAX_PRIORITY),
                            ("expected_output_tokens", expected_output_tokens, 1, _MAX_OUTPUT)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise ValueError(f"{field}.{name}: must be an integer in [{lo}, {hi}], got {v!r}")
    tool = expected_tool_s
    if tool is not None and (isinstance(tool, bool) or not isinstance(tool, (int, float))
                             or not math.isfinite(tool) or not 0 <= tool <= _MAX_TOOL_S):
        raise ValueError(f"{field}.expected_tool_s: must be a finite number in [0, {_MAX_TOOL_S:g}], got {tool!r}")


def hints_from_obj(obj: object, field: str) -> Hints:
    """A decoded JSON hints object (a trace round's ``hints``, the OpenAI body's ``ampd_hints``) as
    Hints; raises ValueError naming the bad key by its path (``FIELD.priority: ...``)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{field}: must be an object with {', '.join(HINT_KEYS)}")
    for key in obj:
        if key not in HINT_KEYS:
            raise ValueError(f"{field}.{key}: unknown hint (known: {', '.join(HINT_KEYS)})")
    p, out, tool = (obj.get(k) for k in HINT_KEYS)
    check_hint_values(p, out, tool, field)
    return Hints(p or 0, out, None if tool is None else float(tool))


@dataclass(slots=True)
class HintConfig:
    """``yield_s``: how much later each step of negative priority enqueues a turn."""

    yield_s: float = 1.0
    kv: KVTierConfig | None = None


def shared_output_tokens(hint: int | None, estimate: float | None, max_tokens: int) -> float | None:
    """Expected output tokens of a round for decisions shared with other sessions (routing's decode
    estimate, KV admission): the larger of hint and estimate, at most ``max_tokens``; None when
    neither is known."""
    known = [x for x in (hint, estimate) if x is not None and math.isfinite(x)]
    return min(max(known), float(max_tokens)) if known else None


def queue_enqueued_at(enqueued_at: float, priority: int, cfg: HintConfig) -> float:
    """The arrival time a prefill queue orders the turn's task by: later by ``-priority * yield_s``
    for a negative priority; a positive priority changes nothing."""
    return enqueued_at + max(0, -priority) * cfg.yield_s


@dataclass(slots=True)
class HintedValues:
    """What the consumers read: ``output_tokens`` (routing, admission), ``enqueued_at`` (queue
    order), ``tool_s`` (the KV tier's decide and prefetch plan), ``tool_rank_end`` (eviction)."""

    output_tokens: float | None
    enqueued_at: float
    tool_s: float | None
    tool_rank_end: float | None


def resolve(h: Hints, cfg: HintConfig, *, enqueued_at: float, max_tokens: int,
            est_output_tokens: float | None, est_tool_s: float | None, tool_start: float) -> HintedValues:
    """Every hinted value of one round at once, each falling back to its windowed estimate."""
    kv = cfg.kv or KVTierConfig()
    hint_tool = effective_tool_s(None, h.expected_tool_s, kv)  # clamped like the decision's
    return HintedValues(shared_output_tokens(h.expected_output_tokens, est_output_tokens, max_tokens),
                        queue_enqueued_at(enqueued_at, h.priority, cfg),
                        effective_tool_s(est_tool_s, h.expected_tool_s, kv),
                        rank_end(tool_start, est_tool_s, hint_tool))
