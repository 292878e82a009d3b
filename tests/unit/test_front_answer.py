"""A turn's answer from its tokens (ampd.front.answer), and StopChecker.extend against add."""
from __future__ import annotations

import random

import pytest

from ampd.chat.stops import StopChecker
from ampd.engine.torch_models import load_tokenizer, smollm2_tokenizer_dir
from ampd.front.answer import Answer, forced_prefix


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_tokenizer_dir())


def _detok(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(12))
def test_extend_gives_the_text_and_finish_of_adding_one_by_one(tok, seed):
    rng = random.Random(seed)
    text = "The weather is fine today; stop here. More text follows after the stop: END of it."
    ids = tok(text, add_special_tokens=False)["input_ids"] + [2] + [rng.randrange(3, 49152) for _ in range(5)]
    stop = rng.choice([(), ("stop here",), ("END", "follows"), ("zzz",)])
    max_tokens = rng.choice([5, 12, 100])
    one = StopChecker(max_tokens, _detok(tok), (2,), (), stop)
    for t in ids:
        if one.add(t):
            break
    many = StopChecker(max_tokens, _detok(tok), (2,), (), stop)
    pos = 0
    while many.finish_reason is None and pos < len(ids):
        n = rng.randint(1, 6)
        many.extend(ids[pos:pos + n])
        pos += n
    assert (many.text, many.finish_reason, many.stop_reason) == (one.text, one.finish_reason, one.stop_reason)


def test_an_answer_streams_its_text_and_counts_its_tokens(tok):
    ids = tok("Hello there, friend.", add_special_tokens=False)["input_ids"]
    a = Answer(50, _detok(tok), (2,))
    out = []
    for t in ids:
        a.add([t])
        out.append(a.text_delta())
    a.add([2])
    a.turn_end("stop")
    out.append(a.rest())
    assert "".join(out) == "Hello there, friend."
    assert a.message(a.calls()) == {"role": "assistant", "content": "Hello there, friend."}
    assert a.usage()["completion_tokens"] == len(ids) + 1


def test_a_forced_call_carries_the_arguments_the_model_wrote(tok):
    a = Answer(50, _detok(tok), (2,), forced="get_weather")
    a.add(tok('{"city": "Paris"}}\n', add_special_tokens=False)["input_ids"])
    (call,) = a.calls()
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    assert a.content() is None and a.openai_finish() == "tool_calls"
    b = Answer(50, _detok(tok), (2,), forced="get_weather")
    b.add(tok("not json at all", add_special_tokens=False)["input_ids"])
    assert b.calls()[0].arguments == "not json at all"
    assert forced_prefix("f").startswith("<tool_call>")


def test_a_first_turn_that_shared_a_prefix_reports_it_as_cached_tokens(tok):
    """--prefix-sharing: a new session's shared prompt blocks are its first round's history (l_hist),
    which the front reports as OpenAI's cached_tokens."""
    from ampd.v1 import common_pb2

    a = Answer(5, _detok(tok), (2,))
    a.round_end(common_pb2.RoundTiming(l_hist=1024, l_incr=57, prefix_shared_tokens=1024))
    a.add([2])
    a.turn_end("stop")
    u = a.usage()
    assert u["prompt_tokens"] == 1081 and u["prompt_tokens_details"] == {"cached_tokens": 1024}
