"""Agent hints (``Turn.hints``, the OpenAI front's ``ampd_hints`` body field, a trace round's
``hints``): their one validity rule and the values the consumers read. A turn's hints cover every
round of the turn (its first and each one a server-side tool call adds); the simulator replays a
trace session as one turn, round 0's hints covering all its rounds (docs/workload.md). What each
hint changes today:

- ``priority``: only a yield counts; it acts on admission's wait and on the prefill queues. A
  positive priority counts as 0 (no hint jumps a queue), so a hint can only cost its own session.
  Admission: a negative priority on a new session's opening turn orders it in admission's wait as
  if it arrived ``-priority * yield_s`` later (``queue_enqueued_at``;
  ``ampd.policy.admit.AdmissionBook``): it stands behind every waiting session that does not yield,
  and is not admitted while another waits; a later turn's priority changes nothing there (admission
  judges a session once). The coordinator (services/coordinator/session.py) and the simulator
  (ampd/sim/admitting.py) apply it alike. Prefill queues: every round of a yielding turn is ordered
  in a prefill worker's queue and in the decode worker's local one as if its input were ready
  ``queue_yield_s`` (``-priority * yield_s``) later (``PrefillTask.queue_yield_s``, set by the
  decode worker from its turn's hints, services/decode, and by the simulator from the session's,
  ampd/sim/loop.py; ``ampd.policy.reorder``): it goes behind a task that does not yield and whose
  input was ready before that, and Algorithm 2 scores its wait from there. Its TTFT is still
  measured from the real input (``enqueued_at``).
- ``expected_tool_s``: the decode worker's host KV tier (``ampd.worker.decode_tier.tier_pause``,
  live and in the simulator) judges the session's own KV by it as well as by the tool's windowed
  duration (``ampd.policy.kvtier.decide_hinted``, clamped to [0, ``max_hint_s``]): it takes the
  hint's keep / offload / drop only where that keeps no more on the device than the estimate's, and
  plans an early prefetch by the later of the two ends (none without an estimate). So a long hint
  moves its own KV off the device sooner; a short or hostile one keeps nothing there, and brings
  nothing back, sooner than the same call without it. Eviction (least recently used first) does
  not read hints.
- ``expected_output_tokens``: raises each of the turn's rounds' expected output (``ampd.policy.outlen``:
  ``min(max_tokens, max(hint, windowed mean))``, the bound while no round is in the window) where a
  decision predicts time from it: the ``slo`` admission rule's ITL prediction counts a new
  session's context at its expected KV (``ampd.policy.admit.decide``'s ``expect``; the coordinator,
  services/coordinator/session.py ``expected_kv``, with the opening turn's hint on each of its
  rounds, scripted ones too; the simulator, ``ampd.sim.admitting``, likewise with round 0's, the
  replayed session's one turn). A hint only makes its own session look
  costlier, so it may get itself refused (``itl``), never another admitted or refused: a hint below
  the mean is no hint. The decisions whose safety rests on the bound (admission's KV promise,
  ``turn_kv_tokens`` without a mean; the decode worker's reservation, ``KvAdmission._round_need``)
  keep ``max_tokens``.

Correctness never depends on a hint: they move time, not tokens.

Pure: no I/O, no clock. ``ampd.agenthints`` reads hints off the wire.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Hints", "HintConfig", "HINTS", "queue_enqueued_at", "queue_yield_s", "check_hint_values", "hints_from_obj", "hints_to_obj",
           "HINT_KEYS"]

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


def hints_to_obj(h: Hints) -> dict[str, int | float]:
    """``h`` as a JSON hints object (``hints_from_obj``'s inverse): the keys given, priority 0 left out."""
    return {k: v for k, v in (("priority", h.priority or None), ("expected_output_tokens", h.expected_output_tokens),
                              ("expected_tool_s", h.expected_tool_s)) if v is not None}


@dataclass(slots=True)
class HintConfig:
    """``yield_s``: how much later each step of negative priority orders a session in admission and
    its rounds in the prefill queues."""

    yield_s: float = 1.0


# The one instance: the coordinator's admission, the decode worker's prefill-queue yield
# (ampd.agenthints) and the simulator read it.
HINTS = HintConfig()


def queue_yield_s(priority: int, cfg: HintConfig) -> float:
    """How much later a queue orders a turn of ``priority`` than it arrived: ``-priority * yield_s``
    for a negative priority; 0 for a positive one (no hint jumps a queue)."""
    return max(0, -priority) * cfg.yield_s


def queue_enqueued_at(enqueued_at: float, priority: int, cfg: HintConfig) -> float:
    """The arrival time admission orders a waiting session by: later by ``queue_yield_s``."""
    return enqueued_at + queue_yield_s(priority, cfg)
