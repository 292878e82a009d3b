"""ChatFormat on SmolLM2's tokenizer: tools, tool calls and results, incremental turns."""

from __future__ import annotations

import pytest

from ampd.chat.template import ChatFormat
from ampd.chat.tokenizer import tokenizer_for
from ampd.chat.toolcalls import ParsedCall, format_tool_call, parse_tool_calls
from ampd.engine.mock import INPUT_VOCAB_SIZE
from ampd.engine.torch_models import save_tiny_llama

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = format_tool_call("get_weather", {"city": "Paris"})
RESULT = '{"temp_c": 18, "sky": "sunny"}'


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(tokenizer_for("mock"))


def _round(fmt: ChatFormat, text: str) -> list[int]:
    """An assistant round as the model emits it: its text's tokens, then the end of turn."""
    return fmt.encode(text) + [fmt.tokenizer.eos_token_id]


def test_the_default_text_tokenizer_is_smollm2s_and_fits_the_mock(fmt):
    tok = fmt.tokenizer
    assert len(tok) == INPUT_VOCAB_SIZE == 49152
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer_for("mock") is tok  # loaded once per process


def test_tokenizer_for_bad_engine_or_model(tmp_path):
    with pytest.raises(ValueError, match="engine: no tokenizer for engine 'sglangx'"):
        tokenizer_for("sglangx", str(tmp_path))
    save_tiny_llama(tmp_path / "tiny")
    with pytest.raises(ValueError, match="model: no tokenizer in"):
        tokenizer_for("torch", str(tmp_path / "tiny"))


def test_without_tools_it_is_the_models_own_template(fmt):
    msgs = [*USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    want = fmt.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert fmt.render(msgs) == list(want)
    assert fmt.render_text(msgs[1:2]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_tools_go_into_the_system_message(fmt):
    text = fmt.render_text(USER, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert '"name": "get_weather"' in text and text.count("<|im_start|>system") == 1
    alone = fmt.render_text(USER[1:], TOOLS)  # no system message: the tools block is one
    assert alone.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in alone
    assert text.endswith("<|im_start|>assistant\n")


def test_assistant_tool_calls_and_tool_results_render_hermes_style(fmt):
    msgs = [*USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": RESULT}]
    text = fmt.render_text(msgs, TOOLS)
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_tool_calls(assistant) == ("", [ParsedCall("get_weather", '{"city": "Paris"}')])
    assert ('<|im_start|>tool\n<tool_response>\n{"name": "get_weather", "content": '
            '"{\\"temp_c\\": 18, \\"sky\\": \\"sunny\\"}"}\n</tool_response><|im_end|>\n') in text


def test_history_plus_tool_result_ids_equals_rendering_the_conversation(fmt):
    """The incremental prefill after a tool call gives the same ids as rendering it all."""
    history = fmt.render(USER, TOOLS) + _round(fmt, "Checking.\n" + CALL)
    history += fmt.tool_result_ids("get_weather", RESULT)
    convo = [*USER, {"role": "assistant", "content": "Checking.\n" + CALL},
             {"role": "tool", "name": "get_weather", "content": RESULT}]
    assert history == fmt.render(convo, TOOLS)
    # the same conversation in OpenAI's structured form renders the call the same way
    structured = [*USER, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "x", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "x", "content": RESULT}]
    assert history == fmt.render(structured, TOOLS)
    # then the answer, and a next user turn appended the same way
    history += _round(fmt, "It is sunny, 18 C.")
    history += fmt.continuation_ids([{"role": "user", "content": "And tomorrow?"}])
    convo += [{"role": "assistant", "content": "It is sunny, 18 C."}, {"role": "user", "content": "And tomorrow?"}]
    assert history == fmt.render(convo, TOOLS)


def test_a_round_cut_before_its_end_of_turn_is_closed_by_the_ids(fmt):
    """Stopped by the stop string </tool_call> (its tokens are in the session, not in the text)."""
    history = fmt.render(USER, TOOLS) + fmt.encode(CALL)
    history += fmt.tool_result_ids("get_weather", RESULT, after_eos=False)
    convo = [*USER, {"role": "assistant", "content": CALL},
             {"role": "tool", "name": "get_weather", "content": RESULT}]
    assert history == fmt.render(convo, TOOLS)


def test_where_equality_cannot_hold_the_text_still_does(fmt):
    """A model may emit a text in other tokens than the tokenizer's own split: then the session's
    ids differ from a re-render, though they spell the same text."""
    tok = fmt.tokenizer
    canonical = fmt.encode(" sunny")
    pieces = [i for ch in " sunny" for i in fmt.encode(ch)]
    assert pieces != canonical and tok.decode(pieces) == tok.decode(canonical)
    history = fmt.render(USER) + pieces + [2] + fmt.continuation_ids([{"role": "user", "content": "ok"}])
    convo = [*USER, {"role": "assistant", "content": " sunny"}, {"role": "user", "content": "ok"}]
    assert history != fmt.render(convo) and tok.decode(history) == tok.decode(fmt.render(convo))


def test_bad_messages_name_the_field(fmt):
    with pytest.raises(ValueError, match=r"messages\[1\].role: must be"):
        fmt.render([USER[1], {"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content: must be a string"):
        fmt.render([{"role": "user", "content": 5}])
    with pytest.raises(ValueError, match=r"messages\[1\]: a tool message needs a name"):
        fmt.render([USER[1], {"role": "tool", "tool_call_id": "nope", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        fmt.render([USER[1], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}])
    with pytest.raises(ValueError, match=r"new_messages\[0\].name"):
        fmt.continuation_ids([{"role": "tool", "tool_call_id": "c1", "content": "x"}])
    with pytest.raises(ValueError, match="new_messages: empty"):
        fmt.continuation_ids([])
    assert fmt.render([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) \
        == fmt.render([{"role": "user", "content": "ab"}])
