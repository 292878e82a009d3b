"""The front's request parsing: every bad field is a 400 naming it (ampd.front.api)."""
from __future__ import annotations

import pytest

from ampd.front.api import ApiError, error_body, parse_chat, parse_completion

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _param(body, parse=parse_chat) -> str | None:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == 400
    return e.value.param


def test_a_plain_request_parses_with_openai_defaults():
    r = parse_chat(OK)
    assert r.model == "m" and r.messages == OK["messages"] and not r.stream
    assert r.sampling.max_tokens is None and r.sampling.temperature == 1.0 and r.sampling.top_p == 1.0
    r = parse_chat({**OK, "max_completion_tokens": 7, "max_tokens": 3, "temperature": 0, "seed": 5, "stop": "x",
                    "stream": True, "stream_options": {"include_usage": True}})
    assert r.sampling.max_tokens == 7 and r.sampling.seed == 5 and r.sampling.stop == ("x",)
    assert r.stream and r.include_usage


@pytest.mark.parametrize("body,param", [
    ({"messages": OK["messages"]}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({**OK, "max_tokens": -1}, "max_tokens"),
    ({**OK, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**OK, "temperature": -0.5}, "temperature"),
    ({**OK, "top_p": 2}, "top_p"),
    ({**OK, "n": 2}, "n"),
    ({**OK, "stop": [""]}, "stop"),
    ({**OK, "stop": ["a"] * 17}, "stop"),
    ({**OK, "seed": -1}, "seed"),
    ({**OK, "stream": "yes"}, "stream"),
    ({**OK, "tools": [{"type": "function"}]}, "tools[0].function.name"),
    ({**OK, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"},
                                 {"role": "tool", "tool_call_id": "c1", "content": "r"}]}, "messages[1].tool_call_id"),
])
def test_bad_fields_are_named(body, param):
    assert _param(body) == param


def test_a_tool_result_must_answer_an_earlier_call():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    assert parse_chat({"model": "m", "messages": msgs}).messages[2]["tool_call_id"] == "c1"
    msgs[2] = {**msgs[2], "tool_call_id": "c2"}
    assert _param({"model": "m", "messages": msgs}) == "messages[2].tool_call_id"


def test_tool_choice_forces_a_named_function():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_chat({**OK, "tools": tools, "tool_choice": "required"}).forced_tool == "f"
    assert parse_chat({**OK, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
                      ).forced_tool == "f"
    assert parse_chat({**OK, "tools": tools, "tool_choice": "auto"}).forced_tool is None


def test_completions():
    assert parse_completion({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3], "return_token_ids": True}).prompt == [1, 2, 3]
    assert _param({"model": "m"}, parse_completion) == "prompt"
    assert _param({"model": "m", "prompt": [1, -2]}, parse_completion) == "prompt[1]"
    assert _param({"model": "m", "prompt": "x", "echo": True}, parse_completion) == "echo"


def test_error_shape():
    body = error_body(ApiError(400, "max_tokens: bad", param="max_tokens"))
    assert body == {"error": {"message": "max_tokens: bad", "type": "invalid_request_error", "param": "max_tokens",
                              "code": None}}
    with pytest.raises(ApiError) as e:
        parse_chat([1, 2])
    assert e.value.status == 400
