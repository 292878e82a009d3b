"""Checks of the session API's messages (proto/ampd/v1: OpenSession, Turn), shared by the
coordinator, which answers the client, and the decode worker, which must not trust its caller.

Each check raises ``InvalidArgument`` naming the first bad field by its path. What only a decode
worker can check (its engine's vocabulary and context limit) is in services/decode/worker.py.
"""
from __future__ import annotations

import math

from ampd.v1 import common_pb2

MAX_SESSION_ID = 256
MAX_TURN_TOKENS = 1 << 20  # new input tokens of one turn (a gRPC message stays far below its 4 MiB limit)
MAX_SCRIPT = 10_000  # scripted calls of one turn
MAX_TOOL_LATENCY_S = 24 * 3600.0
MAX_STOPS = 16


class InvalidArgument(ValueError):
    """A bad request field; the message starts with the field's path."""


def validate_open(o: common_pb2.OpenSession) -> None:
    if not o.session_id:
        raise InvalidArgument("open.session_id: required")
    if len(o.session_id) > MAX_SESSION_ID:
        raise InvalidArgument(f"open.session_id: longer than {MAX_SESSION_ID} characters")
    if not o.HasField("turn"):
        raise InvalidArgument("open.turn: required (a session opens with its first turn)")
    if o.limits.max_rounds < 0:
        raise InvalidArgument(f"open.limits.max_rounds: must be >= 0, got {o.limits.max_rounds}")
    if o.limits.max_output_tokens < 0:
        raise InvalidArgument(f"open.limits.max_output_tokens: must be >= 0, got {o.limits.max_output_tokens}")
    validate_turn(o.turn, "open.turn")


def validate_sampling(p: common_pb2.SamplingParams, path: str) -> None:
    if not p.HasField("max_tokens"):
        raise InvalidArgument(f"{path}.max_tokens: required")
    if p.max_tokens < 1:
        raise InvalidArgument(f"{path}.max_tokens: must be >= 1, got {p.max_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument(f"{path}.temperature: must be a finite number >= 0, got {p.temperature}")
    if not math.isfinite(p.top_p) or not 0 <= p.top_p <= 1:
        raise InvalidArgument(f"{path}.top_p: must be in [0, 1], got {p.top_p}")
    if len(p.stop) > MAX_STOPS:
        raise InvalidArgument(f"{path}.stop: at most {MAX_STOPS} stop strings")
    for i, st in enumerate(p.stop):
        if not st:
            raise InvalidArgument(f"{path}.stop[{i}]: empty")


def validate_turn(t: common_pb2.Turn, path: str = "turn") -> None:
    if not t.token_ids:
        raise InvalidArgument(f"{path}.token_ids: empty input (a turn adds at least one token)")
    if len(t.token_ids) > MAX_TURN_TOKENS:
        raise InvalidArgument(f"{path}.token_ids: {len(t.token_ids)} tokens, over the limit of {MAX_TURN_TOKENS}")
    validate_sampling(t.sampling, f"{path}.sampling")
    if len(t.script) > MAX_SCRIPT:
        raise InvalidArgument(f"{path}.script: {len(t.script)} calls, over the limit of {MAX_SCRIPT}")
    for i, c in enumerate(t.script):
        p = f"{path}.script[{i}]"
        lat = c.tool.latency_s
        if not math.isfinite(lat) or not 0 <= lat <= MAX_TOOL_LATENCY_S:
            raise InvalidArgument(f"{p}.tool.latency_s: must be in [0, {MAX_TOOL_LATENCY_S:g}], got {lat}")
        if c.tool.client_side:
            continue
        if not c.HasField("result_tokens") or c.result_tokens < 1:
            raise InvalidArgument(f"{p}.result_tokens: a server-side call's result needs >= 1 token")
        if c.result_tokens > MAX_TURN_TOKENS:
            raise InvalidArgument(f"{p}.result_tokens: over the limit of {MAX_TURN_TOKENS}")
        validate_sampling(c.sampling, f"{p}.sampling")
