"""ampd.validate: every field of every RPC is checked, and the error names it. Property tests
(hypothesis) throw arbitrary messages at each check: it either accepts or raises InvalidArgument whose
message starts with a field path, never anything else."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampd import trust
from ampd.v1 import common_pb2
from ampd.validate import (
    MAX_ROUNDS, InvalidArgument, TaskTarget, check_hints, stream_message_error, validate_attach, validate_open,
    validate_prefill_task, validate_tool_call,
)


def sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": 4, **kw})


def turn(**kw) -> common_pb2.Turn:
    return common_pb2.Turn(**{"token_ids": [1, 2, 3], "sampling": sampling(), **kw})


def opening(**kw) -> common_pb2.OpenSession:
    return common_pb2.OpenSession(**{"session_id": "s1", "turn": turn(), **kw})


def replay_call(**tool) -> common_pb2.ScriptedCall:
    return common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(**tool), result_tokens=3, sampling=sampling())


def refused(check, *args, field: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        check(*args)
    msg = str(info.value)
    assert msg.startswith(field + ":") or msg.startswith(field + "["), msg
    return msg


def test_a_good_open_passes():
    validate_open(opening(limits=common_pb2.SessionLimits(max_rounds=MAX_ROUNDS, max_output_tokens=100)))
    validate_open(opening(turn=turn(server_tools=["search", "calc"], script=[replay_call(latency_s=0.5)],
                                    tool_call_id="call_1")))
    validate_open(opening(turn=turn(hints=common_pb2.TurnHints(priority=-100, expected_output_tokens=1,
                                                                expected_tool_s=86400.0))))
    validate_open(opening(turn=turn(hints=common_pb2.TurnHints())))  # every hint absent


def hints(**kw) -> common_pb2.Turn:
    return turn(hints=common_pb2.TurnHints(**kw))


@pytest.mark.parametrize("o, field", [
    (opening(session_id=""), "open.session_id"),
    (opening(session_id="x" * 300), "open.session_id"),
    (opening(session_id="a\nb"), "open.session_id"),
    (common_pb2.OpenSession(session_id="s"), "open.turn"),
    (opening(limits=common_pb2.SessionLimits(max_rounds=10_000)), "open.limits.max_rounds"),
    (opening(limits=common_pb2.SessionLimits(max_rounds=-1)), "open.limits.max_rounds"),
    (opening(limits=common_pb2.SessionLimits(max_output_tokens=10**9)), "open.limits.max_output_tokens"),
    (opening(turn=turn(token_ids=[])), "open.turn.token_ids"),
    (opening(turn=common_pb2.Turn(token_ids=[1])), "open.turn.sampling"),
    (opening(turn=turn(sampling=sampling(max_tokens=10**9))), "open.turn.sampling.max_tokens"),
    (opening(turn=turn(sampling=sampling(max_tokens=0))), "open.turn.sampling.max_tokens"),
    (opening(turn=turn(sampling=sampling(temperature=float("nan")))), "open.turn.sampling.temperature"),
    (opening(turn=turn(sampling=sampling(top_p=2.0))), "open.turn.sampling.top_p"),
    (opening(turn=turn(sampling=sampling(stop=[""]))), "open.turn.sampling.stop[0]"),
    (opening(turn=turn(sampling=sampling(stop_token_ids=list(range(100))))), "open.turn.sampling.stop_token_ids"),
    (opening(turn=turn(server_tools=["a", "a"])), "open.turn.server_tools[1]"),
    (opening(turn=turn(server_tools=[""])), "open.turn.server_tools[0]"),
    (opening(turn=turn(script=[replay_call(latency_s=float("nan"))])), "open.turn.script[0].tool.latency_s"),
    (opening(turn=turn(script=[replay_call(latency_s=float("inf"))])), "open.turn.script[0].tool.latency_s"),
    (opening(turn=turn(script=[replay_call(latency_s=-1)])), "open.turn.script[0].tool.latency_s"),
    (opening(turn=turn(script=[replay_call(arguments="[1]")])), "open.turn.script[0].tool.arguments"),
    (opening(turn=turn(script=[replay_call(arguments="{")])), "open.turn.script[0].tool.arguments"),
    (opening(turn=turn(script=[replay_call()] * (MAX_ROUNDS + 1))), "open.turn.script"),
    (opening(turn=turn(script=[common_pb2.ScriptedCall(tool=common_pb2.ToolSpec())])),
     "open.turn.script[0].result_tokens"),
    (opening(turn=hints(priority=101)), "open.turn.hints.priority"),
    (opening(turn=hints(priority=-101)), "open.turn.hints.priority"),
    (opening(turn=hints(expected_output_tokens=0)), "open.turn.hints.expected_output_tokens"),
    (opening(turn=hints(expected_output_tokens=2**31)), "open.turn.hints.expected_output_tokens"),
    (opening(turn=hints(expected_tool_s=-0.5)), "open.turn.hints.expected_tool_s"),
    (opening(turn=hints(expected_tool_s=float("nan"))), "open.turn.hints.expected_tool_s"),
    (opening(turn=hints(expected_tool_s=float("inf"))), "open.turn.hints.expected_tool_s"),
    (opening(turn=hints(expected_tool_s=1e9)), "open.turn.hints.expected_tool_s"),
])
def test_each_bad_field_is_named(o, field):
    refused(validate_open, o, field=field)


@pytest.mark.parametrize("args, field", [
    (("high", None, None), "ampd_hints.priority"),
    ((True, None, None), "ampd_hints.priority"),
    ((None, 2.5, None), "ampd_hints.expected_output_tokens"),
    ((None, None, "3"), "ampd_hints.expected_tool_s"),
    ((None, None, False), "ampd_hints.expected_tool_s"),
])
def test_hint_values_from_json_are_checked_by_type(args, field):
    refused(check_hints, *args, "ampd_hints", field=field)
    check_hints(-3, 200, 2, "ampd_hints")  # an integral number of seconds is fine


def test_a_script_names_only_the_tools_allowed_for_scripting():
    """Issue 24 finding 5: any client ran any sidecar tool with its own arguments through Turn.script."""
    allowed = ("replay",)
    calc = replay_call(name="calculator", arguments='{"expression": "1"}')
    validate_open(opening(turn=turn(script=[replay_call(), replay_call(name="replay")])), script_tools=allowed)
    validate_open(opening(turn=turn(script=[calc])))  # None: no policy (the pure check alone)
    msg = refused(validate_open, opening(turn=turn(script=[replay_call(), calc])), "open", allowed,
                  field="open.turn.script[1].tool.name")
    assert "'calculator' may not be scripted" in msg and "allowed: replay" in msg
    refused(validate_open, opening(turn=turn(script=[replay_call()])), "open", (), field="open.turn.script[0].tool.name")
    validate_open(opening(turn=turn(script=[calc])), script_tools=("replay", "calculator"))
    # a client-side call runs nothing on the sidecar: it goes back to the client
    validate_open(opening(turn=turn(script=[common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(
        name="lookup", client_side=True))])), script_tools=allowed)
    refused(validate_attach, 1.7e9, opening(turn=turn(script=[calc])), allowed, field="open.turn.script[0].tool.name")


def test_attach_checks_its_arrival():
    refused(validate_attach, float("nan"), opening(), field="arrival")
    refused(validate_attach, -1.0, opening(), field="arrival")
    validate_attach(1.7e9, opening())


def test_stream_messages_after_the_opening_one():
    assert stream_message_error("turn", False) == ""
    assert stream_message_error("cancel", True) == ""
    assert stream_message_error("open", False).startswith("open:")
    assert stream_message_error(None, False).startswith("msg:")
    assert stream_message_error("turn", True).startswith("turn:")  # no turn after close
    assert stream_message_error("close", True).startswith("close:")


def test_tool_calls():
    validate_tool_call("replay", '{"q": 1}', 0.5, 10, "s1")
    refused(validate_tool_call, "replay", "", float("inf"), 1, "s", field="latency_s")
    refused(validate_tool_call, "replay", "nope", 0.0, 1, "s", field="arguments")
    refused(validate_tool_call, "x" * 999, "", 0.0, 1, "s", field="name")


# ------------------------------------------------------------------------------ prefill tasks
TARGET = TaskTarget(tp=2, num_blocks=8, block_tokens=16)


def task(**kw) -> common_pb2.PrefillTask:
    base = dict(session_id="s1", round=1, l_hist=20, l_incr=6, input_ready=1.0, decode_worker="decode-0",
                decode_tp=2, token_ids=[1] * 6, sampling=sampling(),
                history=[common_pb2.Segment(block=0, offset=0, tokens=16), common_pb2.Segment(block=1, offset=0, tokens=4)],
                dest=[common_pb2.Segment(block=1, offset=4, tokens=6)])
    base.update(kw)
    return common_pb2.PrefillTask(**base)


def test_a_good_task_passes():
    validate_prefill_task(task(), (1, 2, 4), TARGET)
    validate_prefill_task(task(prefix_tokens=16), (1, 2, 4), TARGET)  # --prefix-sharing
    validate_prefill_task(task(queue_yield_s=100.0), (1, 2, 4), TARGET)  # a yielding turn's hint


@pytest.mark.parametrize("kw, field", [
    (dict(decode_tp=0), "task.decode_tp"),
    (dict(decode_tp=3), "task.decode_tp"),
    (dict(decode_tp=4), "task.decode_tp"),  # served, but not the worker's degree
    (dict(session_id=""), "task.session_id"),
    (dict(decode_worker=""), "task.decode_worker"),
    (dict(l_incr=0, token_ids=[]), "task.l_incr"),
    (dict(token_ids=[1]), "task.token_ids"),
    (dict(input_ready=float("inf")), "task.input_ready"),
    (dict(queue_yield_s=-1.0), "task.queue_yield_s"),  # a hint may only yield
    (dict(queue_yield_s=float("nan")), "task.queue_yield_s"),
    (dict(queue_yield_s=1e9), "task.queue_yield_s"),
    (dict(dest=[common_pb2.Segment(block=99, offset=0, tokens=6)]), "task.dest[0].block"),
    (dict(dest=[common_pb2.Segment(block=2, offset=12, tokens=6)]), "task.dest[0]"),
    (dict(dest=[common_pb2.Segment(block=0, offset=3, tokens=6)]), "task.dest[0]"),  # over history slots
    (dict(dest=[common_pb2.Segment(block=2, offset=0, tokens=5)]), "task.dest"),
    (dict(round=MAX_ROUNDS), "task.round"),
    (dict(prefix_tokens=27), "task.prefix_tokens"),  # past l_hist + l_incr
])
def test_a_bad_task_is_refused_up_front(kw, field):
    refused(validate_prefill_task, task(**kw), (1, 2, 4), TARGET, field=field)


def test_task_tokens_cover_the_segments():
    key = trust.new_key()
    good = task()
    token = trust.task_token(key, good)
    assert trust.token_matches(token, trust.task_token(key, task(task_token=token)))  # the token is not covered
    for forged in (task(dest=[common_pb2.Segment(block=3, offset=0, tokens=6)]), task(session_id="s2"),
                   task(round=2)):
        assert not trust.token_matches(token, trust.task_token(key, forged))
    assert not trust.token_matches(token, trust.task_token(trust.new_key(), good))
    assert not trust.token_matches("", "")
    assert trust.new_call_id() != trust.new_call_id()


def test_task_token_from_the_callers_segments_is_the_messages():
    """A decode worker mints the token from the Segments it holds; a prefill worker checks it
    against the message's own segments: both must give the same token."""
    from ampd.kv import Segment
    key = trust.new_key()
    t = task()
    history = [Segment(s.block, s.offset, s.tokens) for s in t.history]
    dest = [Segment(s.block, s.offset, s.tokens) for s in t.dest]
    assert trust.task_token(key, t, history, dest) == trust.task_token(key, t)
    assert trust.task_token(key, t, history, dest[:-1]) != trust.task_token(key, t)


# ------------------------------------------------------------------------------------- fuzz
FIELD = re.compile(r"^[a-z_]+(\.[a-z_]+|\[\d+\])*: ")
texts = st.text(max_size=12)
floats = st.floats(allow_nan=True, allow_infinity=True)
ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)


@st.composite
def sampling_params(draw):
    p = common_pb2.SamplingParams(temperature=draw(floats.map(lambda x: x if abs(x) < 3e38 or x != x else 0.0)),
                                  top_p=draw(st.floats(width=32)), ignore_eos=draw(st.booleans()),
                                  stop=draw(st.lists(texts, max_size=3)),
                                  stop_token_ids=draw(st.lists(u32, max_size=3)))
    if draw(st.booleans()):
        p.max_tokens = draw(ints)
    return p


@st.composite
def turns(draw):
    t = common_pb2.Turn(token_ids=draw(st.lists(u32, max_size=5)), server_tools=draw(st.lists(texts, max_size=3)),
                        tool_call_id=draw(texts))
    if draw(st.booleans()):
        t.sampling.CopyFrom(draw(sampling_params()))
    for _ in range(draw(st.integers(0, 2))):
        c = t.script.add()
        c.tool.name, c.tool.latency_s, c.tool.client_side = draw(texts), draw(floats), draw(st.booleans())
        c.tool.arguments = draw(st.sampled_from(["", "{}", "[]", "{", '{"a": 1}']))
        if draw(st.booleans()):
            c.result_tokens = draw(ints)
        c.sampling.CopyFrom(draw(sampling_params()))
    if draw(st.booleans()):
        t.hints.priority = draw(ints)
        t.hints.expected_output_tokens = draw(u32)
        t.hints.expected_tool_s = draw(floats)
    return t


@settings(max_examples=300, deadline=None)
@given(sid=texts, max_rounds=ints, max_out=ints, t=st.one_of(st.none(), turns()))
def test_fuzz_open_accepts_or_names_a_field(sid, max_rounds, max_out, t):
    o = common_pb2.OpenSession(session_id=sid, limits=common_pb2.SessionLimits(max_rounds=max_rounds,
                                                                               max_output_tokens=max_out))
    if t is not None:
        o.turn.CopyFrom(t)
    try:
        validate_open(o)
    except InvalidArgument as exc:
        assert FIELD.match(str(exc)), str(exc)


@settings(max_examples=300, deadline=None)
@given(rnd=u32, l_hist=st.integers(0, 64), l_incr=st.integers(0, 40), tp=u32, ready=floats,
       segs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 20), st.integers(0, 20)), max_size=6),
       split=st.integers(0, 6))
def test_fuzz_tasks_accept_or_name_a_field(rnd, l_hist, l_incr, tp, ready, segs, split):
    pb = [common_pb2.Segment(block=b, offset=o, tokens=n) for b, o, n in segs]
    t = task(round=rnd, l_hist=l_hist, l_incr=l_incr, decode_tp=tp, input_ready=ready, token_ids=[1] * l_incr,
             history=pb[:split], dest=pb[split:])
    try:
        validate_prefill_task(t, (1, 2, 4), TARGET)
    except InvalidArgument as exc:
        assert FIELD.match(str(exc)), str(exc)
        return
    # what passes is safe to run: every slot inside the pool, none twice, the counts right
    slots = [(s.block, s.offset + i) for s in (*t.history, *t.dest) for i in range(s.tokens)]
    assert len(slots) == len(set(slots)) == l_hist + l_incr
    assert all(b < TARGET.num_blocks and o < TARGET.block_tokens for b, o in slots)
    assert t.decode_tp == TARGET.tp
