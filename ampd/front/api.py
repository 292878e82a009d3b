"""OpenAI request bodies to what a session turn needs, and errors in OpenAI's shape. Pure.

`parse_chat` and `parse_completion` check a decoded JSON body field by field and raise `ApiError`
(HTTP 400, `param` naming the field) at the first bad one. Extensions beyond OpenAI's fields (the
names vLLM uses): `ignore_eos`, `stop_token_ids`, `return_token_ids` (completions: the prompt and
output token ids in the answer, what a replay client needs to resend the history exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ApiError", "Sampling", "ChatRequest", "CompletionRequest", "parse_chat", "parse_completion",
           "error_body", "MAX_STOPS", "ROLES"]

MAX_STOPS = 16  # the session API's limit (ampd.validate)
ROLES = ("system", "developer", "user", "assistant", "tool")


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


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


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


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


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


def _sampling(body: Mapping) -> Sampling:
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad("n", f"only n=1 is served, got {n!r}")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            max_tokens = _int(body[name], name, 1)
            break
    seed = body.get("seed")
    if seed is not None:
        seed = _int(seed, "seed", 0, (1 << 64) - 1)
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
    if any(not s for s in stops):
        raise bad("stop", "a stop string must not be empty")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list):
        raise bad("stop_token_ids", "must be a list of token ids")
    stop_ids = tuple(_int(t, f"stop_token_ids[{i}]", 0, (1 << 32) - 1) for i, t in enumerate(ids))
    return Sampling(max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0), _number(body, "top_p", 1.0, 0.0, 1.0),
                    seed, stops, stop_ids, _bool(body, "ignore_eos"))


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


def _messages(body: Mapping) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages")
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


def parse_chat(body: Any) -> ChatRequest:
    body = _obj(body)
    model = _model(body)
    messages = _messages(body)
    tools = _tools(body)
    stream, usage = _stream(body)
    return ChatRequest(model, messages, _sampling(body), stream, usage, tools, _tool_choice(body, tools))


# ------------------------------------------------------------------------------- completions
def parse_completion(body: Any) -> CompletionRequest:
    body = _obj(body)
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
    elif isinstance(prompt, list) and prompt:
        # one C pass for the types (bools are not ids), then the range; a bad one is named below
        if not ({*map(type, prompt)} == {int} and min(prompt) >= 0 and max(prompt) < 1 << 32):
            prompt = [_int(t, f"prompt[{i}]", 0, (1 << 32) - 1) for i, t in enumerate(prompt)]  # names the bad one
    else:
        raise bad("prompt", "required: a string or a list of token ids (one prompt per request)")
    for name, off in (("echo", False), ("best_of", 1), ("logprobs", None), ("suffix", None)):
        v = body.get(name)
        if v is not None and not (v is off or (type(v) is type(off) and v == off)) and v != "":
            raise bad(name, "not served")
    stream, usage = _stream(body)
    return CompletionRequest(model, prompt, _sampling(body), stream, usage, _bool(body, "return_token_ids"))
