"""Agent hints off the wire: a ``common_pb2.Turn``'s ``hints`` and the OpenAI front's ``ampd_hints``
body field, as ``ampd.policy.hints.Hints`` (which says what each hint may change, and why a wrong one
costs only its own session). The values are checked by ``ampd.policy.hints.check_hint_values``, one
rule for every door.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampd.policy.hints import HINTS, Hints, hints_from_obj, queue_yield_s
from ampd.v1 import common_pb2
from ampd.validate import InvalidArgument

__all__ = ["BODY_FIELD", "HINTS", "hints_from_turn", "hints_from_body", "hints_to_turn", "turn_queue_yield_s"]

BODY_FIELD = "ampd_hints"  # the OpenAI front's extra body field


def hints_from_turn(turn: common_pb2.Turn) -> Hints:
    """The hints of a validated turn (``validate_turn`` checked their values)."""
    if not turn.HasField("hints"):
        return Hints()
    h = turn.hints
    return Hints(h.priority if h.HasField("priority") else 0,
                 h.expected_output_tokens if h.HasField("expected_output_tokens") else None,
                 h.expected_tool_s if h.HasField("expected_tool_s") else None)


def hints_from_body(body: Mapping[str, Any]) -> Hints:
    """The ``ampd_hints`` object of an OpenAI request body (absent or null: no hints). Raises
    InvalidArgument naming the field (``ampd_hints.expected_tool_s: ...``); the front answers 400."""
    obj = body.get(BODY_FIELD)
    if obj is None:
        return Hints()
    try:
        return hints_from_obj(obj, BODY_FIELD)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def hints_to_turn(h: Hints, turn: common_pb2.Turn) -> None:
    """Set ``turn.hints`` from ``h`` (the front forwards a body's hints on the gRPC Turn); absent
    hints stay absent."""
    if h.priority:
        turn.hints.priority = h.priority
    if h.expected_output_tokens is not None:
        turn.hints.expected_output_tokens = h.expected_output_tokens
    if h.expected_tool_s is not None:
        turn.hints.expected_tool_s = h.expected_tool_s


def turn_queue_yield_s(turn: common_pb2.Turn | None) -> float:
    """``PrefillTask.queue_yield_s`` of a round of ``turn`` (a validated turn; None: no turn): how
    much later the prefill queues order it for a yielding priority hint, else 0."""
    return 0.0 if turn is None else queue_yield_s(turn.hints.priority, HINTS)
