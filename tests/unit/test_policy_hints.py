"""Agent hints (ampd.agenthints, ampd.policy.hints): reading them off the wire, fallbacks to the windowed estimates, and the bounds that
keep a wrong hint from costing another session."""

import math

import pytest

from ampd.agenthints import hints_from_body, hints_from_turn, hints_to_turn
from ampd.policy.hints import HintConfig, Hints, queue_enqueued_at, resolve, shared_output_tokens
from ampd.policy.kvtier import KVTierConfig
from ampd.v1 import common_pb2
from ampd.validate import InvalidArgument

CFG = HintConfig(yield_s=0.5)


def test_from_turn():
    assert hints_from_turn(common_pb2.Turn()) == Hints()
    t = common_pb2.Turn(hints=common_pb2.TurnHints(expected_tool_s=0.0))
    assert hints_from_turn(t) == Hints(0, None, 0.0)  # a present 0 is a hint, not an absence
    t = common_pb2.Turn(hints=common_pb2.TurnHints(priority=-2, expected_output_tokens=300, expected_tool_s=4.5))
    assert hints_from_turn(t) == Hints(-2, 300, 4.5)
    # the front's body hints forwarded on a Turn read back the same
    for h in (Hints(), Hints(-1, None, 0.0), Hints(-2, 300, 4.5)):
        t = common_pb2.Turn()
        hints_to_turn(h, t)
        assert hints_from_turn(t) == h


def test_from_body():
    assert hints_from_body({}) == Hints()
    assert hints_from_body({"ampd_hints": None}) == Hints()
    assert hints_from_body({"ampd_hints": {"priority": -1, "expected_tool_s": 3}}) == Hints(-1, None, 3.0)
    for body, field in [({"ampd_hints": [1]}, "ampd_hints:"),
                        ({"ampd_hints": {"prio": 1}}, "ampd_hints.prio:"),
                        ({"ampd_hints": {"expected_output_tokens": 0}}, "ampd_hints.expected_output_tokens:"),
                        ({"ampd_hints": {"expected_tool_s": -1}}, "ampd_hints.expected_tool_s:")]:
        with pytest.raises(InvalidArgument) as e:
            hints_from_body(body)
        assert str(e.value).startswith(field), str(e.value)


def test_output_tokens_for_shared_decisions_never_below_the_estimate():
    assert shared_output_tokens(None, None, 512) is None
    assert shared_output_tokens(None, 120.0, 512) == 120.0  # no hint: the estimate
    assert shared_output_tokens(300, None, 512) == 300.0  # no estimate: the hint
    assert shared_output_tokens(300, 120.0, 512) == 300.0  # over-claiming costs its own round
    assert shared_output_tokens(1, 120.0, 512) == 120.0  # under-claiming buys nothing
    assert shared_output_tokens(10_000, 120.0, 512) == 512.0  # never past max_tokens
    assert shared_output_tokens(None, math.nan, 512) is None


def test_priority_only_yields():
    assert queue_enqueued_at(10.0, 0, CFG) == 10.0
    assert queue_enqueued_at(10.0, -4, CFG) == 12.0
    assert queue_enqueued_at(10.0, 100, CFG) == 10.0  # a positive priority jumps nobody


def test_resolve_falls_back_to_estimates():
    v = resolve(Hints(), CFG, enqueued_at=5.0, max_tokens=256, est_output_tokens=80.0, est_tool_s=3.0,
                tool_start=100.0)
    assert (v.output_tokens, v.enqueued_at, v.tool_s, v.tool_rank_end) == (80.0, 5.0, 3.0, 103.0)
    v = resolve(Hints(), CFG, enqueued_at=5.0, max_tokens=256, est_output_tokens=None, est_tool_s=None,
                tool_start=100.0)
    assert (v.output_tokens, v.tool_s, v.tool_rank_end) == (None, None, None)


def test_resolve_with_hints_and_a_hostile_one():
    honest = resolve(Hints(-2, 200, 30.0), CFG, enqueued_at=5.0, max_tokens=256, est_output_tokens=80.0,
                     est_tool_s=3.0, tool_start=100.0)
    assert (honest.output_tokens, honest.enqueued_at, honest.tool_s, honest.tool_rank_end) == (200.0, 6.0, 30.0, 130.0)
    # says its tool returns at once: its own KV stays (tool_s 0), but eviction still ranks it by
    # the 3 s estimate, and it claims no fewer output tokens than the estimate
    liar = resolve(Hints(100, 1, 0.0), CFG, enqueued_at=5.0, max_tokens=256, est_output_tokens=80.0,
                   est_tool_s=3.0, tool_start=100.0)
    assert (liar.output_tokens, liar.enqueued_at, liar.tool_s, liar.tool_rank_end) == (80.0, 5.0, 0.0, 103.0)
    # a tool hint beyond the limit is clamped
    far = resolve(Hints(0, None, 1e9), HintConfig(kv=KVTierConfig(max_hint_s=60.0)), enqueued_at=0.0,
                  max_tokens=1, est_output_tokens=None, est_tool_s=None, tool_start=0.0)
    assert (far.tool_s, far.tool_rank_end) == (60.0, 60.0)


def test_the_pure_parser_has_the_session_apis_ranges():
    """A trace round's hints (ampd.policy.hints.hints_from_obj, pure) are checked with the session
    API's ranges (ampd.validate), and name the bad key alike."""
    from ampd.policy import hints as ph
    from ampd.validate import MAX_OUTPUT_TOKENS, MAX_PRIORITY, MAX_TOOL_LATENCY_S

    assert (ph._MAX_PRIORITY, ph._MAX_OUTPUT, ph._MAX_TOOL_S) == (MAX_PRIORITY, MAX_OUTPUT_TOKENS, MAX_TOOL_LATENCY_S)
    assert ph.hints_from_obj({}, "h") == Hints()
    assert ph.hints_from_obj({"priority": -3, "expected_output_tokens": 9, "expected_tool_s": 2}, "h") == Hints(-3, 9, 2.0)
    for obj in ({"priority": 101}, {"priority": 1.5}, {"expected_output_tokens": 0}, {"expected_tool_s": math.inf},
                {"expected_tool_s": -1}, {"expected_tool_s": True}, {"x": 1}, [1]):
        with pytest.raises(ValueError) as pure:
            ph.hints_from_obj(obj, "ampd_hints")
        with pytest.raises(InvalidArgument) as wire:
            hints_from_body({"ampd_hints": obj})
        assert str(pure.value).split(":")[0] == str(wire.value).split(":")[0]


def test_a_trace_round_carries_hints_and_a_bad_one_is_named():
    from ampd.workload.trace import TraceError, session_from_obj, session_to_obj

    obj = {"id": "s", "arrival": 0.0, "rounds": [{"input": 3, "output": 2, "hints": {"priority": -2, "expected_tool_s": 1.5}},
                                                 {"input": 4, "output": 2}]}
    s = session_from_obj(obj, "t.jsonl:1")
    assert s.rounds[0].hints == Hints(-2, None, 1.5) and s.rounds[1].hints is None
    assert session_to_obj(s) == obj and session_from_obj(session_to_obj(s), "x") == s
    obj["rounds"][0]["hints"] = {"expected_output_tokens": 0}
    with pytest.raises(TraceError, match=r"t.jsonl:1: field 'rounds\[0\].hints.expected_output_tokens'"):
        session_from_obj(obj, "t.jsonl:1")
