"""Agent hints off the wire: a ``common_pb2.Turn``'s ``hints`` and the OpenAI front's ``ampd_hints``
body field, as ``ampd.policy.hints.Hints`` (which says what each hint may change, and why a wrong one
costs only its own session). The values are checked by ``ampd.validate.check_hints``, one rule for
both doors.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampd.policy.hints import Hints
from ampd.v1 import common_pb2
from ampd.validate import InvalidArgument, check_hints

__all__ = ["BODY_FIELD", "hints_from_turn", "hints_from_body", "hints_to_turn"]

BODY_FIELD = "ampd_hints"  # the OpenAI front's extra body field
_BODY_KEYS = ("priority", "expected_output_tokens", "expected_tool_s")


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
    if not isinstance(obj, Mapping):
        raise InvalidArgument(f"{BODY_FIELD}: must be an object with {', '.join(_BODY_KEYS)}")
    for key in obj:
        if key not in _BODY_KEYS:
            raise InvalidArgument(f"{BODY_FIELD}.{key}: unknown hint (known: {', '.join(_BODY_KEYS)})")
    p, out, tool = (obj.get(k) for k in _BODY_KEYS)
    check_hints(p, out, tool, BODY_FIELD)
    return Hints(0 if p is None else p, out, None if tool is None else float(tool))


def hints_to_turn(h: Hints, turn: common_pb2.Turn) -> None:
    """Set ``turn.hints`` from ``h`` (the front forwards a body's hints on the gRPC Turn); absent
    hints stay absent."""
    if h.priority:
        turn.hints.priority = h.priority
    if h.expected_output_tokens is not None:
        turn.hints.expected_output_tokens = h.expected_output_tokens
    if h.expected_tool_s is not None:
        turn.hints.expected_tool_s = h.expected_tool_s
