"""The decode worker's own checks of a turn (``services.decode.session.check_turn``): the context limit
counts the output still to come, so a session moved mid-round is not refused for output it already made."""
import pytest

from ampd.engine.mock import MockEngine
from ampd.perf import load_profile
from ampd.v1 import common_pb2, decode_pb2
from services.decode.session import InvalidTurn, check_turn, made_before_move


@pytest.fixture(scope="module")
def engine() -> MockEngine:
    return MockEngine(load_profile("qwen3-32b@h20"), 2)


def _turn(tokens: int, max_tokens: int) -> common_pb2.Turn:
    t = common_pb2.Turn(token_ids=[1] * tokens)
    t.sampling.max_tokens = max_tokens
    return t


def test_a_turn_whose_output_would_pass_the_limit_is_refused_naming_the_field(engine):
    limit = engine.max_context
    check_turn(_turn(limit - 100, 100), engine, 0, "open.turn")
    with pytest.raises(InvalidTurn, match=rf"^open\.turn\.sampling\.max_tokens: {limit - 100} context tokens \+ 101 "):
        check_turn(_turn(limit - 100, 101), engine, 0, "open.turn")


def test_a_session_moved_mid_round_counts_only_the_output_still_to_come(engine):
    """Moved after 2,000 of a 3,000-token round: its history holds those 2,000, 1,000 are to come."""
    limit = engine.max_context
    moved = _turn(limit - 1_000, 3_000)
    check_turn(moved, engine, 0, "open.turn", carried=2_000)
    with pytest.raises(InvalidTurn, match=r"1001 output tokens to come \(1999 of them already made\)"):
        check_turn(moved, engine, 0, "open.turn", carried=1_999)
    with pytest.raises(InvalidTurn, match="3000 output tokens to come exceed"):  # not moved: all of it to come
        check_turn(moved, engine, 0, "open.turn")


def test_the_output_made_before_a_move_is_read_from_the_resume_only_when_the_round_goes_on():
    req = decode_pb2.AttachRequest()
    assert made_before_move(req) == 0  # a new session
    req.resume.round_tokens = 2_000
    assert made_before_move(req) == 2_000
    req.resume.rerun_tools = True  # its tool calls run again: that round is over
    assert made_before_move(req) == 0
