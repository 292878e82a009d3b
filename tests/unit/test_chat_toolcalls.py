"""Hermes / ChatML tool calls out of a round's text."""

from __future__ import annotations

import json

import pytest

from ampd.chat.toolcalls import ParsedCall, format_tool_call, parse_tool_calls


def test_one_call_with_content_before_it():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(text) == ("Let me check.", [ParsedCall("get_weather", '{"city": "Paris"}')])


def test_several_calls_in_order_and_text_between_them_kept():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": {"y": [1, 2], "z": "é"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "and"
    assert [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].arguments) == {"y": [1, 2], "z": "é"} and "é" in calls[1].arguments


def test_no_call_leaves_the_text_alone():
    assert parse_tool_calls("  plain answer \n") == ("  plain answer \n", [])


@pytest.mark.parametrize("body", [
    '{"name": "a", "arguments": {"x": 1}',       # truncated JSON
    '["a"]',                                      # not an object
    '{"arguments": {}}',                          # no name
    '{"name": "", "arguments": {}}',              # empty name
    '{"name": 3, "arguments": {}}',               # name not a string
    '{"name": "a", "arguments": [1]}',            # arguments not an object
    '{"name": "a", "arguments": "not json"}',     # arguments a string that is not JSON
    'get_weather(city="Paris")',                  # not JSON at all
])
def test_malformed_block_is_no_call_and_stays_as_text(body):
    text = f"Hmm <tool_call>{body}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_a_malformed_block_does_not_hide_a_good_one():
    text = '<tool_call>{oops</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text) == ("<tool_call>{oops</tool_call>", [ParsedCall("b", "{}")])
    text = '<tool_call>{oops <tool_call>{"name": "b"}</tool_call>'  # an unclosed bad block
    assert parse_tool_calls(text) == ("<tool_call>{oops", [ParsedCall("b", "{}")])


def test_arguments_as_json_text_or_missing():
    got = parse_tool_calls('<tool_call>{"name": "b", "arguments": "{\\"q\\": 1}"}</tool_call>')
    assert got == ("", [ParsedCall("b", '{"q": 1}')])
    assert parse_tool_calls('<tool_call>{"name": "b"}</tool_call>') == ("", [ParsedCall("b", "{}")])


def test_last_block_cut_by_a_stop_string_counts_when_its_json_is_complete():
    done = 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    assert parse_tool_calls(done) == ("ok", [ParsedCall("f", '{"a": 1}')])
    cut = 'ok <tool_call>\n{"name": "f", "argum'  # max_tokens ran out inside the call
    assert parse_tool_calls(cut) == (cut, [])


def test_format_reads_back():
    for args in ({"city": "Paris", "n": [1, 2]}, '{"city": "東京"}', {}):
        text = format_tool_call("get_weather", args)
        want = args if isinstance(args, dict) else json.loads(args)
        (call,) = parse_tool_calls(text)[1]
        assert call.name == "get_weather" and json.loads(call.arguments) == want
    assert format_tool_call("f", {"a": 1}) == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
