"""A resent conversation renders to the ids its session holds (ampd.chat.conversation)."""
from __future__ import annotations

import pytest

from ampd.chat.conversation import answer_digest, render_conversation
from ampd.chat.template import ChatFormat
from ampd.engine.torch_models import load_tokenizer, smollm2_tokenizer_dir


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(load_tokenizer(smollm2_tokenizer_dir()))


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVO = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C."},
    {"role": "user", "content": "Thanks!"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_unknown_answers_render_as_the_whole_conversation(fmt):
    r = render_conversation(fmt, CONVO, TOOLS, lambda d: None)
    assert r.answers == 2 and r.known == 0
    assert r.ids == fmt.render(CONVO, TOOLS)


def test_known_answers_keep_the_ids_the_session_holds(fmt):
    # the model's own ids for its answers (here: a different split than the tokenizer's)
    own = {answer_digest(None, [CALL]): [101, 102, 103, fmt.tokenizer.eos_token_id],
           answer_digest("It is 18 C.", None): [201, 202]}  # no end-of-turn: stopped by max_tokens
    r = render_conversation(fmt, CONVO, TOOLS, own.get)
    assert r.known == 2
    head = fmt.render(CONVO[:1], TOOLS)
    first = head + own[answer_digest(None, [CALL])]
    assert r.ids[:len(first)] == first
    second_at = len(first) + len(fmt.continuation_ids([{**CONVO[2], "name": "get_weather"}]))
    assert r.ids[second_at:second_at + 2] == [201, 202]
    # after an answer that did not end with end-of-turn, the continuation closes it first
    assert r.ids[second_at + 2:] == fmt.continuation_ids(CONVO[4:], after_eos=False)


def test_the_digest_names_content_and_calls():
    assert answer_digest("a", None) == answer_digest("a", [])
    assert answer_digest("a", None) != answer_digest("b", None)
    assert answer_digest(None, [CALL]) != answer_digest(None, [{**CALL, "id": "call_2"}])


def test_arguments_that_are_no_json_object_still_render(fmt):
    odd = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    convo = [CONVO[0], {"role": "assistant", "content": None, "tool_calls": [odd]},
             {"role": "tool", "tool_call_id": "c", "content": "r"}]
    r = render_conversation(fmt, convo, None, lambda d: None)
    assert "not json" in fmt.tokenizer.decode(r.ids)
