"""StopChecker: finish reasons, the text OpenAI returns, incremental decoding of a tail."""

from __future__ import annotations

import random

import pytest

from ampd.chat.stops import StopChecker
from ampd.chat.tokenizer import tokenizer_for

# A byte-level toy vocabulary: like a BPE tokenizer's, a token may hold part of a character.
PIECES = {0: b"<eos>", 1: b"Hello", 2: b" world", 3: b"!", 4: b" STOP", 5: b"ST", 6: b"OP",
          7: "é".encode()[:1], 8: "é".encode()[1:], 9: b"\n", 10: b"x"}
calls: list[int] = []


def detok(ids) -> str:
    calls.append(len(ids))
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def run(ids, **kw) -> StopChecker:
    kw.setdefault("max_tokens", 100)
    c = StopChecker(detokenize=detok, **kw)
    for i in ids:
        if c.add(i) is not None:
            break
    return c


def test_max_tokens_gives_length():
    c = run([1, 2, 3, 10, 10], max_tokens=3)
    assert (c.finish_reason, c.tokens, c.text, c.stop_reason) == ("length", [1, 2, 3], "Hello world!", None)
    with pytest.raises(RuntimeError, match="already finished"):
        c.add(1)


def test_eos_stops_unless_ignored_and_is_not_in_the_text():
    c = run([1, 2, 0, 3], eos_token_ids=[0])
    assert (c.finish_reason, c.stop_reason, c.tokens, c.text) == ("stop", 0, [1, 2, 0], "Hello world")
    c = run([1, 0, 3], eos_token_ids=[0], ignore_eos=True, max_tokens=3)
    assert (c.finish_reason, c.text) == ("length", "Hello<eos>!")
    # stop_token_ids stop even with ignore_eos
    c = run([1, 3, 2], eos_token_ids=[0], stop_token_ids=[3], ignore_eos=True)
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", 3, "Hello")


def test_stop_string_is_cut_from_the_text_even_across_tokens():
    c = run([1, 2, 4, 3], stop=["STOP"])
    assert (c.finish_reason, c.stop_reason, c.text, c.tokens) == ("stop", "STOP", "Hello world ", [1, 2, 4])
    c = run([1, 5, 6, 3], stop=["TO", "xx"])  # spans tokens 5 and 6
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", "TO", "HelloS")
    c = run([1, 5, 3, 10], stop=["STOP"], max_tokens=4)  # a prefix that never completes
    assert (c.finish_reason, c.text) == ("length", "HelloST!x")
    c = run([1, 9, 3], stop=["\n"])  # the earliest of several stops wins
    assert c.text == "Hello"
    # the stop on the last allowed token is a stop, not length
    c = run([1, 4], stop=["STOP"], max_tokens=2)
    assert (c.finish_reason, c.text) == ("stop", "Hello ")


def test_partial_characters_wait_for_their_rest():
    c = StopChecker(max_tokens=10, detokenize=detok, stop=["é!"])
    c.add(1)
    c.add(7)
    assert c.text == "Hello"  # half of é: nothing new yet
    c.add(8)
    assert c.text == "Helloé"
    assert c.add(3) == "stop" and c.text == "Hello"
    # cut by length in the middle of a character: the replacement character shows it
    c = run([1, 7], max_tokens=2)
    assert c.text == "Hello\ufffd"
    c = run([10, 7, 0], eos_token_ids=[0])
    assert c.text == "x\ufffd"


def test_delta_holds_back_only_a_possible_stop_start():
    c = StopChecker(max_tokens=10, detokenize=detok, stop=["STOP"])
    out = []
    for t in [1, 2, 5]:
        c.add(t)
        out.append(c.delta())
    assert out == ["Hello", " world", ""]  # "ST" may begin STOP
    c.add(3)
    assert c.delta() == "ST!"
    assert c.add(4) == "stop" and c.stop_reason == "STOP"
    assert c.delta() == " " and c.text == "Hello worldST! "
    c = StopChecker(max_tokens=2, detokenize=detok, stop=["STOP"])
    c.add(1)
    c.add(5)
    assert c.finish_reason == "length" and c.delta() == "HelloST"  # finished: nothing held


def test_decoding_stays_incremental():
    calls.clear()
    c = StopChecker(max_tokens=2000, detokenize=detok, stop=["zz"])
    for _ in range(1000):
        c.add(10)
    assert c.text == "x" * 1000 and c.finish_reason is None
    assert max(calls) <= 2  # never the whole output


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="max_tokens: must be >= 1"):
        StopChecker(max_tokens=0, detokenize=detok)
    with pytest.raises(ValueError, match="stop: "):
        StopChecker(max_tokens=5, detokenize=detok, stop=[""])


def test_incremental_text_equals_decoding_the_whole_output_on_smollm2():
    tok = tokenizer_for("mock")

    def dec(ids):
        return tok.decode(ids, skip_special_tokens=True)

    rng = random.Random(0)
    text = "Größe: 12 × 3 = 36 😀 — café, naïve; 東京 “quoted” \n\tdone."
    ids = tok.encode(text)
    noise = [rng.randrange(3, 49152) for _ in range(200)]
    for stream in (ids, noise, ids + noise):
        c = StopChecker(max_tokens=len(stream), detokenize=dec)
        for t in stream:
            c.add(t)
        assert c.finish_reason == "length" and c.text == dec(stream)
    c = StopChecker(max_tokens=100, detokenize=dec, stop=["36 😀"], eos_token_ids=[2])
    for t in ids:
        if c.add(t):
            break
    assert (c.finish_reason, c.text) == ("stop", "Größe: 12 × 3 = ")
