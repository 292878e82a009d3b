"""The front's request parsing: every bad field is a 400 naming it (ampd.front.api)."""
from __future__ import annotations

import pytest

from ampd.front.api import (MAX_JSON_DEPTH, ApiError, RequestLimits, check_depth, error_body, parse_chat,
                           parse_completion, text_chars)
from ampd.validate import MAX_OUTPUT_TOKENS, MAX_TURN_TOKENS

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


# ------------------------------------------------------------------------- issue 24: bounds
def _error(body, parse=parse_chat, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, **kw)
    return e.value


def _nested(depth: int) -> dict:
    """A JSON-schema-like object `depth` levels deep (built without recursion)."""
    node: dict = {"type": "string"}
    for _ in range(depth - 1):
        node = {"p": node}
    return node


def test_nesting_is_bounded_iteratively_and_names_the_field():
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(1000)}}]
    with pytest.raises(ApiError) as e:
        check_depth({**OK, "tools": tools})
    assert e.value.status == 400 and e.value.param == "tools" and e.value.code == "nesting_too_deep"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in e.value.message
    assert "tools[0].function.parameters.p.p" in e.value.message
    # the body is level 1: a value MAX_JSON_DEPTH levels deep in all passes, one more does not
    check_depth({"a": _nested(MAX_JSON_DEPTH - 1)})
    with pytest.raises(ApiError):
        check_depth({"a": _nested(MAX_JSON_DEPTH)})
    with pytest.raises(ApiError) as e:
        check_depth({"messages": [[[[1]]]]}, limit=3)
    assert e.value.param == "messages" and "messages[0][0]" in e.value.message


def test_a_flat_list_is_checked_in_one_pass():
    check_depth({"prompt": list(range(1 << 20))})  # no per-element Python loop (timed by the suite)


@pytest.mark.parametrize("body,param", [
    ({**OK, "max_tokens": 2147483648}, "max_tokens"),  # int32 on the wire: was a 500 ValueError
    ({**OK, "max_tokens": MAX_OUTPUT_TOKENS + 1}, "max_tokens"),
    ({**OK, "max_completion_tokens": 1 << 40}, "max_completion_tokens"),
    ({**OK, "seed": 1 << 64}, "seed"),
    ({**OK, "stop_token_ids": [1 << 32]}, "stop_token_ids[0]"),
    ({**OK, "stop_token_ids": list(range(100))}, "stop_token_ids"),  # was reported as "stop"
    ({**OK, "stop": "x" * 300}, "stop"),
    ({**OK, "temperature": 1e300}, "temperature"),
])
def test_fields_beyond_the_wire_ranges_are_named(body, param):
    e = _error(body)
    assert (e.status, e.param) == (400, param)
    assert e.message.startswith(f"{param}: ")


@pytest.mark.parametrize("name,value", [
    ("logprobs", True), ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {}}), ("n", 2), ("presence_penalty", 0.5),
    ("frequency_penalty", -1), ("logit_bias", {"50256": -100}), ("parallel_tool_calls", False),
    ("top_k", 5), ("repetition_penalty", 1.2), ("logprobs", 1),
])
def test_parameters_not_implemented_are_refused_by_name(name, value):
    e = _error({**OK, name: value})
    assert (e.status, e.param, e.code) == (400, name, "unsupported_parameter")
    assert "not supported" in e.message


@pytest.mark.parametrize("name,value", [
    ("logprobs", False), ("logprobs", None), ("top_logprobs", 0), ("response_format", {"type": "text"}),
    ("n", 1), ("presence_penalty", 0), ("frequency_penalty", 0.0), ("logit_bias", {}), ("parallel_tool_calls", True),
    ("user", "someone"), ("store", False), ("metadata", {"k": "v"}),
])
def test_harmless_defaults_stay_accepted(name, value):
    parse_chat({**OK, name: value})


def test_completions_refuse_what_they_do_not_implement():
    ok = {"model": "m", "prompt": "hi"}
    for name, value in (("echo", True), ("best_of", 2), ("suffix", "x"), ("logprobs", 2)):
        e = _error({**ok, name: value}, parse_completion)
        assert (e.param, e.code) == (name, "unsupported_parameter")
    parse_completion({**ok, "echo": False, "best_of": 1, "suffix": "", "logprobs": None})


def test_size_limits_come_before_tokenizing():
    limits = RequestLimits(max_messages=3, max_chars=100)
    many = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 4}
    e = _error(many, limits=limits)
    assert (e.param, e.code) == ("messages", "context_length_exceeded") and "3" in e.message
    long = {"model": "m", "messages": [{"role": "user", "content": "x" * 101}]}
    e = _error(long, limits=limits)
    assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 101}]}]}
    assert _error(parts, limits=limits).param == "messages"
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 90}}]
    assert _error({**OK, "tools": tools}, limits=limits).param == "tools"
    e = _error({"model": "m", "prompt": "z" * 101}, parse_completion, limits=limits)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    parse_chat(OK, limits)
    parse_completion({"model": "m", "prompt": "z" * 100}, limits)


def test_a_token_prompt_is_bounded_by_the_wire():
    e = _error({"model": "m", "prompt": [1] * (MAX_TURN_TOKENS + 1)}, parse_completion)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")


def test_text_chars_counts_keys_and_strings_without_recursion():
    assert text_chars({"ab": ["cd", {"e": "fgh"}], "i": 3}) == 2 + 2 + 1 + 3 + 1
    assert text_chars(_nested(5000)) > 0


def test_agent_hints_are_parsed_and_a_bad_one_is_named():
    from ampd.policy.hints import Hints
    assert parse_chat(OK).hints == Hints()
    r = parse_chat({**OK, "ampd_hints": {"priority": -2, "expected_output_tokens": 40, "expected_tool_s": 1.5}})
    assert r.hints == Hints(-2, 40, 1.5)
    comp = {"model": "m", "prompt": "hi"}
    assert parse_completion({**comp, "ampd_hints": {"expected_tool_s": 0}}).hints == Hints(0, None, 0.0)
    for hints, param in [({"priority": 101}, "ampd_hints.priority"),
                         ({"priority": True}, "ampd_hints.priority"),
                         ({"expected_output_tokens": 0}, "ampd_hints.expected_output_tokens"),
                         ({"expected_tool_s": -1}, "ampd_hints.expected_tool_s"),
                         ({"expected_tool_s": "soon"}, "ampd_hints.expected_tool_s"),
                         ({"deadline": 3}, "ampd_hints.deadline"),
                         ([1], "ampd_hints")]:
        assert _param({**OK, "ampd_hints": hints}) == param
        assert _param({**comp, "ampd_hints": hints}, parse_completion) == param
