"""Checks of every RPC's fields (proto/ampd/v1): the session API (OpenSession, Turn, the client's
stream), the decode worker's calls, a prefill task, a tool call. The coordinator answers the client
with them; every worker runs them again on what it receives, since it must not trust its caller.

Pure: no I/O, no clock. Each check raises ``InvalidArgument`` naming the first bad field by its path
(``open.turn.sampling.max_tokens: ...``); a service turns it into INVALID_ARGUMENT. What only a
decode worker can check (its engine's vocabulary and context limit, the session's pending calls) is
in services/decode/worker.py; what only a prefill worker knows (the decode worker's pool layout and
task key) comes in as a ``TaskTarget``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, replace

from ampd.policy.hints import check_hint_values
from ampd.v1 import common_pb2

# Limits of the API. They bound what one request may make a server hold or do; the gRPC message
# limits (ampd.grpcserver: 4 MiB from clients, more between services) bound the bytes.
MAX_ID = 256  # session ids, tool call ids, tool names (they go into Redis keys and logs)
MAX_TURN_TOKENS = 1 << 20  # new input tokens of one turn (5 MiB of varints: the 4 MiB limit cuts first)
MAX_OUTPUT_TOKENS = 1 << 20  # max_tokens of one round; a decode worker also caps it by its context
MAX_ROUNDS = 1024  # rounds of one session (limits.max_rounds, scripted calls of one turn, tool loops)
MAX_TOOL_LATENCY_S = 24 * 3600.0
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SERVER_TOOLS = 64
MAX_ARGUMENTS = 1 << 16  # bytes of a tool call's JSON arguments
MAX_REASON = 256  # a cancel's reason
MAX_TP = 64
MAX_CONTEXT = 1 << 22  # tokens of one session's context (history + new input)
MAX_SEGMENTS = 1 << 16  # segments of one prefill task (a 1M-token context in 16-token blocks)
MAX_PRIORITY = 100  # |Turn.hints.priority|
# PrefillTask.queue_yield_s: a yielding hint orders a task at most MAX_PRIORITY * yield_s later
# (100 s by default); an hour leaves room for a larger yield_s and bounds what a task may claim
MAX_QUEUE_YIELD_S = 3600.0


class InvalidArgument(ValueError):
    """A bad request field; the message starts with the field's path."""


def _id(value: str, path: str, required: bool = True) -> None:
    if not value:
        if required:
            raise InvalidArgument(f"{path}: required")
        return
    if len(value) > MAX_ID:
        raise InvalidArgument(f"{path}: longer than {MAX_ID} characters")
    if not value.isprintable():
        raise InvalidArgument(f"{path}: only printable characters")


def _finite(value: float, path: str, lo: float, hi: float) -> None:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidArgument(f"{path}: must be a finite number in [{lo:g}, {hi:g}], got {value}")


# ------------------------------------------------------------------------------- session API
def validate_open(o: common_pb2.OpenSession, path: str = "open", script_tools: Collection[str] | None = None) -> None:
    _id(o.session_id, f"{path}.session_id")
    _id(o.prefix_scope, f"{path}.prefix_scope", required=False)  # hashed per block, and kept per session
    if not o.HasField("turn"):
        raise InvalidArgument(f"{path}.turn: required (a session opens with its first turn)")
    if not 0 <= o.limits.max_rounds <= MAX_ROUNDS:
        raise InvalidArgument(f"{path}.limits.max_rounds: must be in [0, {MAX_ROUNDS}] (0: {MAX_ROUNDS}), "
                              f"got {o.limits.max_rounds}")
    if not 0 <= o.limits.max_output_tokens <= MAX_OUTPUT_TOKENS:
        raise InvalidArgument(f"{path}.limits.max_output_tokens: must be in [0, {MAX_OUTPUT_TOKENS}], "
                              f"got {o.limits.max_output_tokens}")
    validate_turn(o.turn, f"{path}.turn", script_tools)


def validate_sampling(p: common_pb2.SamplingParams, path: str) -> None:
    if not p.HasField("max_tokens"):
        raise InvalidArgument(f"{path}.max_tokens: required")
    if not 1 <= p.max_tokens <= MAX_OUTPUT_TOKENS:
        raise InvalidArgument(f"{path}.max_tokens: must be in [1, {MAX_OUTPUT_TOKENS}], got {p.max_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument(f"{path}.temperature: must be a finite number >= 0, got {p.temperature}")
    if not math.isfinite(p.top_p) or not 0 <= p.top_p <= 1:
        raise InvalidArgument(f"{path}.top_p: must be in [0, 1], got {p.top_p}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"{path}.stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
    if len(p.stop) > MAX_STOPS:
        raise InvalidArgument(f"{path}.stop: at most {MAX_STOPS} stop strings")
    for i, st in enumerate(p.stop):
        if not st or len(st) > MAX_STOP_CHARS:
            raise InvalidArgument(f"{path}.stop[{i}]: must be 1 to {MAX_STOP_CHARS} characters")


def _arguments(text: str, path: str) -> None:
    if len(text.encode()) > MAX_ARGUMENTS:
        raise InvalidArgument(f"{path}: over {MAX_ARGUMENTS} bytes")
    if text:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise InvalidArgument(f"{path}: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise InvalidArgument(f"{path}: must be a JSON object")


def validate_turn(t: common_pb2.Turn, path: str = "turn", script_tools: Collection[str] | None = None) -> None:
    """``script_tools``: the server-side tools a scripted call may name (the deployment's
    ``script_tools``; an empty name is ``replay``); None: any. A script runs a tool with the client's
    own arguments, so only tools meant for replay are allowed."""
    if not t.token_ids:
        raise InvalidArgument(f"{path}.token_ids: empty input (a turn adds at least one token)")
    if len(t.token_ids) > MAX_TURN_TOKENS:
        raise InvalidArgument(f"{path}.token_ids: {len(t.token_ids)} tokens, over the limit of {MAX_TURN_TOKENS}")
    if not t.HasField("sampling"):
        raise InvalidArgument(f"{path}.sampling: required")
    validate_sampling(t.sampling, f"{path}.sampling")
    if len(t.server_tools) > MAX_SERVER_TOOLS:
        raise InvalidArgument(f"{path}.server_tools: at most {MAX_SERVER_TOOLS} names")
    seen: set[str] = set()
    for i, name in enumerate(t.server_tools):
        _id(name, f"{path}.server_tools[{i}]")
        if name in seen:
            raise InvalidArgument(f"{path}.server_tools[{i}]: {name!r} is listed twice")
        seen.add(name)
    _id(t.tool_call_id, f"{path}.tool_call_id", required=False)
    if len(t.script) > MAX_ROUNDS:
        raise InvalidArgument(f"{path}.script: {len(t.script)} calls, over the limit of {MAX_ROUNDS} rounds")
    for i, c in enumerate(t.script):
        p = f"{path}.script[{i}]"
        _id(c.tool.name, f"{p}.tool.name", required=False)
        _finite(c.tool.latency_s, f"{p}.tool.latency_s", 0.0, MAX_TOOL_LATENCY_S)
        _arguments(c.tool.arguments, f"{p}.tool.arguments")
        if c.tool.client_side:
            continue
        if script_tools is not None and (c.tool.name or "replay") not in script_tools:
            raise InvalidArgument(f"{p}.tool.name: {c.tool.name!r} may not be scripted on this deployment "
                                  f"(allowed: {', '.join(sorted(script_tools)) or 'none'})")
        if not c.HasField("result_tokens") or not 1 <= c.result_tokens <= MAX_TURN_TOKENS:
            raise InvalidArgument(f"{p}.result_tokens: a server-side call's result needs 1 to {MAX_TURN_TOKENS} "
                                  f"tokens, got {c.result_tokens if c.HasField('result_tokens') else 'none'}")
        validate_sampling(c.sampling, f"{p}.sampling")
    if t.HasField("hints"):
        validate_hints(t.hints, f"{path}.hints")


def check_hints(priority: int | None, expected_output_tokens: int | None, expected_tool_s: float | None,
                path: str) -> None:
    """A turn's hints (``TurnHints``), each None when absent: ``ampd.policy.hints``'s one rule."""
    try:
        check_hint_values(priority, expected_output_tokens, expected_tool_s, path)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def validate_hints(h: common_pb2.TurnHints, path: str) -> None:
    check_hints(h.priority if h.HasField("priority") else None,
                h.expected_output_tokens if h.HasField("expected_output_tokens") else None,
                h.expected_tool_s if h.HasField("expected_tool_s") else None, path)


def stream_message_error(kind: str | None, closing: bool) -> str:
    """What is wrong with a client message on a session's stream after the opening one ("" if
    nothing): only turn, stop, close and cancel may follow, and nothing but stop or cancel follows a
    close."""
    if kind not in ("turn", "stop", "close", "cancel"):
        return f"{kind or 'msg'}: the session is already open on this stream; send turn, stop, close or cancel"
    if closing and kind not in ("stop", "cancel"):
        return f"{kind}: the session is closing (close was sent); only stop or cancel may follow"
    return ""


def validate_reason(reason: str, path: str) -> None:
    if len(reason) > MAX_REASON:
        raise InvalidArgument(f"{path}: longer than {MAX_REASON} characters")


def validate_attach(arrival: float, o: common_pb2.OpenSession, script_tools: Collection[str] | None = None) -> None:
    """Decode.Attach: the opening message and the time the coordinator accepted it."""
    _finite(arrival, "arrival", 0.0, 1e11)
    validate_open(o, script_tools=script_tools)


# ---------------------------------------------------------------------------------- tool calls
def validate_tool_call(name: str, arguments: str, latency_s: float, result_tokens: int, session_id: str) -> None:
    """ToolSidecar.Call (sidecar_pb2.ToolCallRequest's fields)."""
    _id(session_id, "session_id", required=False)
    _id(name, "name", required=False)
    _arguments(arguments, "arguments")
    _finite(latency_s, "latency_s", 0.0, MAX_TOOL_LATENCY_S)
    if result_tokens > MAX_TURN_TOKENS:
        raise InvalidArgument(f"result_tokens: over the limit of {MAX_TURN_TOKENS}")


# -------------------------------------------------------------------------------- prefill tasks
@dataclass(frozen=True)
class TaskTarget:
    """What a prefill worker knows of a task's decode worker (from its registration)."""

    tp: int
    num_blocks: int
    block_tokens: int
    host_blocks: int = 0  # its host KV tier's blocks (0: none; PrefillTask.history_on_host)


def _segments(segs, path: str, tokens: int, target: TaskTarget | None,
              used: dict[int, list[tuple[int, int]]]) -> None:
    if len(segs) > MAX_SEGMENTS:
        raise InvalidArgument(f"{path}: over {MAX_SEGMENTS} segments")
    # A task names ~one segment a block: each field is read once into a local (a protobuf
    # attribute read costs more than the checks), and only a block seen before is searched for
    # overlaps. This runs on every remote prefill's path.
    num_blocks = target.num_blocks if target is not None else -1
    block_tokens = target.block_tokens if target is not None else -1
    total = 0
    for i, s in enumerate(segs):
        block, offset, n = s.block, s.offset, s.tokens
        if n < 1:
            raise InvalidArgument(f"{path}[{i}].tokens: must be >= 1")
        end = offset + n
        if num_blocks >= 0:
            if block >= num_blocks:
                raise InvalidArgument(f"{path}[{i}].block: {block} is outside the decode worker's "
                                      f"{num_blocks} blocks")
            if end > block_tokens:
                raise InvalidArgument(f"{path}[{i}]: offset {offset} + {n} tokens overflow a block of "
                                      f"{block_tokens}")
        # no token slot twice: two segments over one slot would read or write it twice
        spans = used.get(block)
        if spans is None:
            used[block] = [(offset, end)]
        else:
            for a, b in spans:
                if a < end and offset < b:
                    raise InvalidArgument(f"{path}[{i}]: block {block} slots {offset}..{end - 1} are named twice")
            spans.append((offset, end))
        total += n
    if total != tokens:
        raise InvalidArgument(f"{path}: segments cover {total} tokens, not {tokens}")


def validate_prefill_task(task: common_pb2.PrefillTask, tps: tuple[int, ...] = (),
                          target: TaskTarget | None = None, path: str = "task") -> None:
    """Prefill.Submit: a task's fields; with ``target`` (its decode worker's registration) also its
    degree and that every segment lies inside that worker's pool. ``tps``: the degrees this worker's
    profile can time a transfer for."""
    _id(task.session_id, f"{path}.session_id")
    _id(task.decode_worker, f"{path}.decode_worker")
    if task.round >= MAX_ROUNDS:
        raise InvalidArgument(f"{path}.round: must be < {MAX_ROUNDS}, got {task.round}")
    if task.l_incr < 1:
        raise InvalidArgument(f"{path}.l_incr: must be >= 1, got {task.l_incr}")
    if task.l_hist + task.l_incr > MAX_CONTEXT:
        raise InvalidArgument(f"{path}.l_incr: l_hist + l_incr is over the limit of {MAX_CONTEXT} tokens")
    if len(task.token_ids) != task.l_incr:
        raise InvalidArgument(f"{path}.token_ids: {len(task.token_ids)} tokens, not l_incr={task.l_incr}")
    if task.prefix_tokens > task.l_hist + task.l_incr:
        raise InvalidArgument(f"{path}.prefix_tokens: {task.prefix_tokens}, over l_hist + l_incr")
    _finite(task.input_ready, f"{path}.input_ready", 0.0, 1e11)
    _finite(task.queue_yield_s, f"{path}.queue_yield_s", 0.0, MAX_QUEUE_YIELD_S)
    if not 1 <= task.decode_tp <= MAX_TP or (tps and task.decode_tp not in tps):
        allowed = ", ".join(map(str, tps)) if tps else f"1..{MAX_TP}"
        raise InvalidArgument(f"{path}.decode_tp: {task.decode_tp} is not a served degree ({allowed})")
    if target is not None and task.decode_tp != target.tp:
        raise InvalidArgument(f"{path}.decode_tp: {task.decode_tp}, but {task.decode_worker!r} runs at TP {target.tp}")
    validate_sampling(task.sampling, f"{path}.sampling")
    used: dict[int, list[tuple[int, int]]] = {}
    if task.history_on_host:  # the history lies in the host pool: its blocks are that pool's
        if target is not None and not target.host_blocks:
            raise InvalidArgument(f"{path}.history_on_host: decode worker {task.decode_worker!r} has no host KV tier")
        host = None if target is None else replace(target, num_blocks=target.host_blocks)
        _segments(task.history, f"{path}.history", task.l_hist, host, {})
    else:
        _segments(task.history, f"{path}.history", task.l_hist, target, used)
    _segments(task.dest, f"{path}.dest", task.l_incr, target, used)
