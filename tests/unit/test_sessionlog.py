"""The coordinator's record of a session and the Resume it builds when the session's decode worker
is lost (ampd/sessionlog.py)."""
from __future__ import annotations

import pytest

from ampd.sessionlog import CannotResume, SessionLog
from ampd.v1 import common_pb2


def _sampling(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, ignore_eos=True)


def _turn() -> common_pb2.Turn:
    call = common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(name="replay", latency_s=1.0), result_tokens=3,
                                   sampling=_sampling(4))
    return common_pb2.Turn(token_ids=[1, 2, 3], sampling=_sampling(5), script=[call])


def _task(rnd: int, l_hist: int, ids: list[int], ready: float = 10.0) -> common_pb2.PrefillTask:
    return common_pb2.PrefillTask(round=rnd, l_hist=l_hist, l_incr=len(ids), token_ids=ids, input_ready=ready)


def _tokens(rnd: int, pos: int, ids: list[int], t: float = 11.0) -> common_pb2.Tokens:
    return common_pb2.Tokens(round=rnd, position=pos, token_ids=ids, times=[t] * len(ids))


def _log() -> SessionLog:
    lg = SessionLog("s", common_pb2.SessionLimits())
    lg.on_turn(_turn())
    return lg


def test_a_round_cut_mid_decode_continues_with_the_rest_of_its_tokens():
    lg = _log()
    lg.on_prefill_task(_task(0, 0, [1, 2, 3]))
    lg.on_tokens(_tokens(0, 3, [50, 51]))
    assert lg.lost() == "turn"
    req = lg.resume()
    assert list(req.open.turn.token_ids) == [1, 2, 3, 50, 51]
    assert req.resume.round == 0 and req.resume.round_tokens == 2 and not req.resume.rerun_tools
    assert req.open.turn.sampling.max_tokens == 5 and len(req.open.turn.script) == 1
    # the new worker's prefill of the whole history, then its tokens: the round ends with all five
    lg.on_prefill_task(_task(0, 0, [1, 2, 3, 50, 51], ready=20.0))
    lg.on_tokens(_tokens(0, 5, [52, 53, 54], t=21.0))
    timing = common_pb2.RoundTiming(round=0, tokens=3, first_token=21.0, input_ready=20.0, recovered=True)
    lg.on_round_end(timing)
    assert (timing.tokens, timing.first_token, timing.input_ready) == (5, 11.0, 10.0)
    assert lg.history == [1, 2, 3, 50, 51, 52, 53, 54]


def test_a_round_ended_with_a_pending_server_call_runs_the_call_again():
    lg = _log()
    lg.on_prefill_task(_task(0, 0, [1, 2, 3]))
    lg.on_tokens(_tokens(0, 3, [50, 51, 52, 53, 54]))
    lg.on_round_end(common_pb2.RoundTiming(round=0, tokens=5))
    lg.on_tool_call(common_pb2.ToolCall(round=0, call_id="s/0", name="replay"))
    req = lg.resume()
    assert req.resume.rerun_tools and req.resume.round == 1
    assert len(req.open.turn.script) == 1  # the call to run again comes first
    assert list(req.open.turn.token_ids) == [1, 2, 3, 50, 51, 52, 53, 54]


def test_a_later_round_resumes_with_its_scripted_sampling():
    lg = _log()
    lg.on_prefill_task(_task(0, 0, [1, 2, 3]))
    lg.on_tokens(_tokens(0, 3, [50, 51, 52, 53, 54]))
    lg.on_round_end(common_pb2.RoundTiming(round=0, tokens=5))
    lg.on_prefill_task(_task(1, 7, [54, 7, 8, 9]))  # last output token + the tool's result
    lg.on_tokens(_tokens(1, 11, [60]))
    req = lg.resume()
    assert req.resume.round == 1 and req.resume.round_tokens == 1
    assert req.open.turn.sampling.max_tokens == 4 and len(req.open.turn.script) == 0
    assert list(req.open.turn.token_ids) == [1, 2, 3, 50, 51, 52, 53, 54, 7, 8, 9, 60]


def test_an_idle_session_moves_with_the_next_turn_and_a_lost_turn_end_is_sent():
    lg = SessionLog("s", common_pb2.SessionLimits())
    lg.on_turn(common_pb2.Turn(token_ids=[1, 2], sampling=_sampling(2)))
    lg.on_prefill_task(_task(0, 0, [1, 2]))
    lg.on_tokens(_tokens(0, 2, [5, 6]))
    lg.on_round_end(common_pb2.RoundTiming(round=0, tokens=2, finish_reason="length"))
    assert lg.lost() == "turn_end"  # its TurnEnd never came
    end = lg.turn_end()
    assert (end.round, end.finish_reason, end.history_tokens) == (0, "length", 4)
    assert lg.lost() == "idle"
    with pytest.raises(CannotResume, match="turn.tool_call_id"):
        lg.resume(common_pb2.Turn(token_ids=[9], sampling=_sampling(1), tool_call_id="nope"))
    req = lg.resume(common_pb2.Turn(token_ids=[9], sampling=_sampling(3), keep_tokens=3))
    assert list(req.open.turn.token_ids) == [1, 2, 5, 9] and not req.open.turn.HasField("keep_tokens")
    assert req.resume.round == 1 and req.resume.round_tokens == 0


def test_expected_sizes_are_the_decode_workers_for_a_client_turn():
    """The first round of a turn prefills the last output token and the turn's input on top of
    every other token (services/decode/worker.py begin_round): the coordinator's route for it is
    decided for those sizes (decode.proto Route)."""
    lg = SessionLog("s", common_pb2.SessionLimits())
    opening = common_pb2.Turn(token_ids=[1, 2, 3], sampling=_sampling(2))
    assert lg.expected_sizes(opening) == (0, 3)
    lg.on_turn(opening)
    lg.on_round_start(0, 10.0)
    lg.on_tokens(_tokens(0, 3, [50, 51]))
    nxt = common_pb2.Turn(token_ids=[7, 8], sampling=_sampling(2))
    assert lg.expected_sizes(nxt) == (4, 3)  # 5 tokens, the last output one not in the KV yet
    edited = common_pb2.Turn(token_ids=[9], sampling=_sampling(2), keep_tokens=2)
    assert lg.expected_sizes(edited) == (2, 1)  # the history is cut back to 2 tokens, all in the KV


def test_a_round_started_with_its_turn_resumes_like_one_started_by_its_prefill_task():
    by_task, by_turn = _log(), _log()
    by_task.on_prefill_task(_task(0, 0, [1, 2, 3], ready=10.0))
    by_turn.on_round_start(0, 10.0)
    for lg in (by_task, by_turn):
        lg.on_tokens(_tokens(0, 3, [50]))
    assert by_task.history == by_turn.history == [1, 2, 3, 50]
    assert by_task.resume() == by_turn.resume()
    assert by_task.carry == by_turn.carry == (0, 1, 11.0, 10.0)


def test_a_log_rebuilt_from_the_workers_state_moves_the_session_like_the_original():
    """A session reattached through another coordinator (decode.proto SessionState): when its decode
    worker dies later, the rebuilt log builds the same Resume as the lost coordinator's would have."""
    from ampd.v1 import decode_pb2

    lg = _log()
    lg.on_prefill_task(_task(0, 0, [1, 2, 3]))
    lg.on_tokens(_tokens(0, 3, [50, 51]))
    st = decode_pb2.SessionState(seq=7, history=lg.history, turn=lg.turn, turn_round=0, next_round=1, round=0,
                                 round_tokens=2, round_ended=False, turns=1, first_token_at=11.0, input_ready=10.0)
    again = SessionLog.from_state("s", st)
    assert again.lost() == lg.lost() == "turn"
    assert again.resume() == lg.resume()
    # between turns, with a client-side call pending: idle, and the call's answer resumes it
    idle = decode_pb2.SessionState(history=[1, 2, 3, 50], next_round=1, round=0, round_ended=True,
                                   client_calls=["call_x"], turns=1)
    lg2 = SessionLog.from_state("s", idle)
    assert lg2.lost() == "idle"
    req = lg2.resume(common_pb2.Turn(token_ids=[9], sampling=_sampling(2), tool_call_id="call_x"))
    assert list(req.open.turn.token_ids) == [1, 2, 3, 50, 9] and req.resume.round == 1 and req.resume.turns == 2


def test_tokens_the_reattached_state_held_are_logged_once():
    """The first Tokens after a reattach can carry tokens the worker's state already held, merged
    with new ones (services/coordinator/session.py, SessionRun._unlogged): the round's count takes
    only the new ones, so a later move resumes the round where it stopped."""
    from ampd.v1 import decode_pb2
    from services.coordinator.session import SessionRun

    lg = _log()
    lg.on_prefill_task(_task(0, 0, [1, 2, 3]))
    lg.on_tokens(_tokens(0, 3, [50, 51]))
    st = decode_pb2.SessionState(seq=7, history=lg.history, turn=lg.turn, turn_round=0, next_round=1, round=0,
                                 round_tokens=2, round_ended=False, turns=1, first_token_at=11.0, input_ready=10.0)
    run = SessionRun.__new__(SessionRun)  # (only its log and what the state logged)
    run.log, run.logged_to = SessionLog.from_state("s", st), len(st.history)
    merged = _tokens(0, 4, [51, 52])  # 51 was in the state; 52 is new
    run.log.on_tokens(run._unlogged(merged))
    assert list(merged.token_ids) == [51, 52]  # the client's event is left whole
    assert run.log.history == [1, 2, 3, 50, 51, 52] and run.log.round_tokens == 3
    assert run.log.resume().resume.round_tokens == 3
    later = _tokens(0, 6, [53])
    assert run._unlogged(later) is later
