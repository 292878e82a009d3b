"""OpenAI request bodies to what a session turn needs, and errors in OpenAI's shape. Pure.

`parse_chat` and `parse_completion` check a decoded JSON body field by field and raise `ApiError`
(HTTP 400, `param` naming the field) at the first bad one. Extensions beyond OpenAI's fields (the
names vLLM uses): `ignore_eos`, `stop_token_ids`, `return_token_ids` (completions: the prompt and
output token ids in the answer, what a replay client needs to resend the history exactly).

Bounds (issue 24): a body nests at most `MAX_JSON_DEPTH` levels (`check_depth`, run before any
recursive walk); numeric fields are checked against the session API's ranges (ampd.validate), so
nothing reaches the wire that its proto type cannot hold; `ampd_hints` (agent hints, ampd.agenthints:
advice only) is checked by the session API's rule and a bad one is a 400 naming it
(`ampd_hints.expected_tool_s`); a request's text and message count are
checked against the front's `RequestLimits` before anything tokenizes it; OpenAI parameters AMPD does
not implement are refused by name (`UNSUPPORTED`), except at their harmless defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ampd.agenthints import hints_from_body
from ampd.policy.hints import Hints
from ampd.validate import InvalidArgument, MAX_OUTPUT_TOKENS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, MAX_TURN_TOKENS

__all__ = ["ApiError", "Sampling", "ChatRequest", "CompletionRequest", "RequestLimits", "parse_chat",
           "parse_completion", "check_depth", "text_chars", "error_body", "MAX_JSON_DEPTH", "ROLES", "UNSUPPORTED"]

ROLES = ("system", "developer", "user", "assistant", "tool")
# Levels of JSON nesting a body may have. A tool's parameter schema nests a few levels per object
# property; 64 leaves room for any real schema and keeps every recursive walk of the body (templates,
# digests, re-encoding) far from Python's recursion limit (issue 24: 1,000 levels raised RecursionError).
MAX_JSON_DEPTH = 64
MAX_SEED = (1 << 64) - 1  # uint64 on the wire
MAX_TOKEN_ID = (1 << 32) - 1  # uint32 on the wire
# OpenAI (and vLLM) request parameters AMPD does not implement, each with the values that ask for
# nothing (accepted). Any other value is a 400 "not supported" naming the parameter: silently ignoring
# it would answer something other than what was asked. Completions add theirs (_COMPLETION_ONLY).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "parallel_tool_calls": (None, True),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "top_k": (None, -1, 0),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "prompt_logprobs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    # vLLM's: narrows prefix sharing within a tenant. Sessions share only within their tenant here
    # (OpenSession.prefix_scope); a salt ignored would promise isolation that the tenant's sessions
    # (shared by design, history matching included) do not give
    "cache_salt": (None, ""),
}
_COMPLETION_ONLY: dict[str, tuple[Any, ...]] = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, "")}


@dataclass(frozen=True)
class RequestLimits:
    """What one request may make the front tokenize (ampd.config: max_messages, max_prompt_chars)."""
    max_messages: int
    max_chars: int


class ApiError(Exception):
    """An HTTP error in OpenAI's shape. ``retry_after`` (seconds) marks a retryable refusal (429/503):
    the answer carries it as Retry-After. A permanent error has none and is a 4xx other than 429, so
    that OpenAI's SDKs, which retry 429 and 5xx, do not send it again."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.retry_after = retry_after


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def check_depth(body: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raises a 400 naming the field when a decoded JSON body nests deeper than ``limit`` (the top
    object is level 1). Iterative: it must not itself be what recursion breaks on."""
    stack: list[tuple[Any, int, tuple | None]] = [(body, 1, None)]  # (value, its level, (parent node, key))
    while stack:
        node = stack.pop()
        value, level = node[0], node[1]
        if level > limit:
            path = _path(node)
            field_ = path.split(".")[0].split("[")[0] or None
            short = path if len(path) <= 120 else f"{path[:60]}...{path[-40:]}"
            raise ApiError(400, f"{field_ or 'body'}: JSON nests deeper than {limit} levels (at {short})",
                           param=field_, code="nesting_too_deep")
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            if not {*map(type, value)} & {dict, list}:  # a flat list (token ids, strings): one C pass
                continue
            items = enumerate(value)
        else:
            continue
        for k, v in items:
            if isinstance(v, (dict, list)):
                stack.append((v, level + 1, (node, k)))


def _path(node: tuple) -> str:
    keys = []
    while node[2] is not None:
        node, k = node[2]
        keys.append(k)
    out = ""
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: the front's default
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    tools: list[dict] = field(default_factory=list)
    forced_tool: str | None = None  # tool_choice naming a function (or "required" with one tool)
    hints: Hints = field(default_factory=Hints)  # the body's ampd_hints (none: no hints)


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    hints: Hints = field(default_factory=Hints)


# ------------------------------------------------------------------------------------- fields
def _obj(body: Any) -> Mapping:
    if not isinstance(body, Mapping):
        raise ApiError(400, "body: must be a JSON object", param=None)
    return body


def _model(body: Mapping) -> str:
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise bad("model", "required (a string; GET /v1/models lists them)")
    return m


def _bool(body: Mapping, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


def _number(body: Mapping, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(name, f"must be a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _int(v: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"must be an integer {bound}, got {v!r}")
    return v


def _unsupported(body: Mapping, table: Mapping[str, tuple[Any, ...]]) -> None:
    for name, harmless in table.items():
        v = body.get(name)
        if v is not None and not any(_same(v, h) for h in harmless if h is not None):
            raise bad(name, f"not supported (AMPD serves {name} only as {_shown(harmless)}), got {_short(v)}",
                      code="unsupported_parameter")


def _same(v: Any, h: Any) -> bool:
    """JSON equality: 0 == 0.0, but True is not 1 and 0 is not false (as they are in Python)."""
    if isinstance(v, bool) or isinstance(h, bool) or not isinstance(v, (int, float)):
        return type(v) is type(h) and v == h
    return isinstance(h, (int, float)) and v == h


def _shown(values: tuple[Any, ...]) -> str:
    return " or ".join("null" if v is None else json.dumps(v) for v in values)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _sampling(body: Mapping) -> Sampling:
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad("n", f"not supported: only n=1 is served, got {_short(n)}", code="unsupported_parameter")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            max_tokens = _int(body[name], name, 1, MAX_OUTPUT_TOKENS)
            break
    seed = body.get("seed")
    if seed is not None:
        seed = _int(seed, "seed", 0, MAX_SEED)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"a stop string must be 1 to {MAX_STOP_CHARS} characters")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list):
        raise bad("stop_token_ids", "must be a list of token ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
    stop_ids = tuple(_int(t, f"stop_token_ids[{i}]", 0, MAX_TOKEN_ID) for i, t in enumerate(ids))
    return Sampling(max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0), _number(body, "top_p", 1.0, 0.0, 1.0),
                    seed, stops, stop_ids, _bool(body, "ignore_eos"))


def _hints(body: Mapping) -> Hints:
    """The body's ``ampd_hints``; a bad one is a 400 whose ``param`` names the hint."""
    try:
        return hints_from_body(body)
    except InvalidArgument as exc:
        msg = str(exc)
        raise ApiError(400, msg, param=msg.split(":", 1)[0], code="invalid_hint") from None


def _stream(body: Mapping) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, Mapping):
        raise bad("stream_options", "must be an object")
    return stream, _bool(opts, "include_usage") if "include_usage" in opts else False


# -------------------------------------------------------------------------------------- chat
def _tools(body: Mapping) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "must be a list")
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type", "function") != "function":
            raise bad(f"tools[{i}].type", "only function tools are served")
        fn = t.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}].function.name", "required")
    return [dict(t) for t in tools]


def _tool_choice(body: Mapping, tools: list[dict]) -> str | None:
    choice = body.get("tool_choice")
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if len(names) != 1:
            raise bad("tool_choice", "'required' is served with exactly one tool; name the function instead")
        return names[0]
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if name in names:
            return name
        raise bad("tool_choice.function.name", f"must name one of the tools ({', '.join(names) or 'none given'})")
    raise bad("tool_choice", f"must be 'auto', 'none', 'required' or a function, got {choice!r}")


def text_chars(value: Any) -> int:
    """Characters of every string (keys too) in a decoded JSON value: what templating and
    tokenizing it cost. Iterative (a body's depth is checked first, but this must not recurse)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += sum(map(len, v))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def _too_long(param: str, chars: int, limits: RequestLimits) -> ApiError:
    return bad(param, f"{chars} characters of text, over the front's limit of {limits.max_chars} "
                      "(--max-prompt-chars)", code="context_length_exceeded")


def _messages(body: Mapping, limits: RequestLimits | None = None) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages")
    if limits is not None:
        if len(msgs) > limits.max_messages:
            raise bad("messages", f"{len(msgs)} messages, over the front's limit of {limits.max_messages} "
                                  "(--max-messages)", code="context_length_exceeded")
        chars = text_chars(msgs)
        if chars > limits.max_chars:
            raise _too_long("messages", chars, limits)
    calls: set[str] = set()
    answered: set[str] = set()
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise bad(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if not (content is None or isinstance(content, str) or (isinstance(content, list) and all(
                isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content))):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        if role == "developer":  # OpenAI's newer name for the system message
            m = {**m, "role": "system"}
        if role == "assistant":
            tcs = m.get("tool_calls")
            if tcs is not None:
                if not isinstance(tcs, list):
                    raise bad(f"messages[{i}].tool_calls", "must be a list")
                for j, c in enumerate(tcs):
                    fn = c.get("function") if isinstance(c, Mapping) else None
                    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                        raise bad(f"messages[{i}].tool_calls[{j}].function.name", "required")
                    if not isinstance(fn.get("arguments", ""), str):
                        raise bad(f"messages[{i}].tool_calls[{j}].function.arguments", "must be a string")
                    if not isinstance(c.get("id"), str) or not c["id"]:
                        raise bad(f"messages[{i}].tool_calls[{j}].id", "required")
                    calls.add(c["id"])
        elif content is None:
            raise bad(f"messages[{i}].content", "required")
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in calls:
                raise bad(f"messages[{i}].tool_call_id", f"{cid!r} answers no tool call of an earlier "
                                                         "assistant message")
            answered.add(cid)
        out.append(dict(m))
    return out


def parse_chat(body: Any, limits: RequestLimits | None = None) -> ChatRequest:
    """The request, or ApiError at its first bad field. ``limits``: the front's size limits (None:
    none, for tests); the body's nesting is checked by the caller (`check_depth`), right after parsing."""
    body = _obj(body)
    model = _model(body)
    messages = _messages(body, limits)
    tools = _tools(body)
    if limits is not None and tools:
        chars = text_chars(messages) + text_chars(tools)
        if chars > limits.max_chars:
            raise _too_long("tools", chars, limits)
    stream, usage = _stream(body)
    _unsupported(body, UNSUPPORTED)
    return ChatRequest(model, messages, _sampling(body), stream, usage, tools, _tool_choice(body, tools),
                       _hints(body))


# ------------------------------------------------------------------------------- completions
def parse_completion(body: Any, limits: RequestLimits | None = None) -> CompletionRequest:
    """As `parse_chat`; a text prompt is bounded by ``limits.max_chars``, token ids by the wire's
    MAX_TURN_TOKENS."""
    body = _obj(body)
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
        if limits is not None and len(prompt) > limits.max_chars:
            raise _too_long("prompt", len(prompt), limits)
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_TURN_TOKENS:
            raise bad("prompt", f"{len(prompt)} token ids, over the limit of {MAX_TURN_TOKENS}",
                      code="context_length_exceeded")
        # one C pass for the types (bools are not ids), then the range; a bad one is named below
        if not ({*map(type, prompt)} == {int} and min(prompt) >= 0 and max(prompt) < 1 << 32):
            prompt = [_int(t, f"prompt[{i}]", 0, MAX_TOKEN_ID) for i, t in enumerate(prompt)]  # names the bad one
    else:
        raise bad("prompt", "required: a string or a list of token ids (one prompt per request)")
    _unsupported(body, {**UNSUPPORTED, **_COMPLETION_ONLY})
    stream, usage = _stream(body)
    return CompletionRequest(model, prompt, _sampling(body), stream, usage, _bool(body, "return_token_ids"),
                             _hints(body))
