"""The decode worker's own checks of a turn (``services.decode.session.check_turn``): the context limit
counts the output still to come, so a session moved mid-round is not refused for output it already made."""
import pytest

from ampd.engine.mock import MockEngine
from ampd.perf import load_profile
from ampd.v1 import common_pb2
from services.decode.session import InvalidTurn, check_turn


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
