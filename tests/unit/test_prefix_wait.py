"""Waiting for prefix blocks still being written (ampd/policy/prefixwait.py) and the simulator's use of it."""
from __future__ import annotations

import pytest

from ampd.policy.prefixwait import Landing, wait_until
from ampd.sim import simulate
from ampd.sim.prefixing import HASH_BLOCK_TOKENS
from ampd.workload import Round, Session
from test_sim import _profile


def test_a_round_waits_when_the_blocks_land_before_its_own_prefill_of_them_would_be_done():
    # prefilling itself: 1.0 s; once they land: 0.2 s
    assert wait_until(10.0, 10.5, 1.0, 0.2) == pytest.approx(11.0)  # due in 0.5 s: wait, at most 1.0 s
    assert wait_until(10.0, 10.9, 1.0, 0.2) == pytest.approx(11.0)  # (at most 0.1 s later than not waiting)
    assert wait_until(10.0, 11.0, 1.0, 0.2) is None  # due as its own prefill would be done: no
    assert wait_until(10.0, 10.1, 0.2, 0.2) is None  # nothing saved
    assert wait_until(10.0, 9.0, 1.0, 0.2) == pytest.approx(11.0)  # the writer is late: it waits its own prefill's time
    # the TTFT SLO: prefilling itself meets it (1.5 s left), waiting must too (first token by 1.3 + 0.2)
    assert wait_until(10.0, 10.5, 1.0, 0.2, ttft_left_s=1.5) == pytest.approx(11.0)
    assert wait_until(10.0, 10.9, 1.0, 0.2, ttft_left_s=1.0) is None
    assert wait_until(10.0, 10.5, 1.0, 0.2, ttft_left_s=1.0) == pytest.approx(10.8)
    # one it misses anyway: the saving decides
    assert wait_until(10.0, 10.9, 1.0, 0.2, ttft_left_s=0.5) == pytest.approx(11.0)


def test_landing_finds_the_longest_writer_and_hands_back_its_waiters_once():
    ld = Landing()
    ld.writing("a", (1, 2, 3), 5.0)
    ld.writing("b", (1, 2, 9, 9), 4.0)
    ld.writing("c", (), 1.0)  # writes nothing: not a writer
    assert ld.longest((1, 2, 3, 4)) == ("a", 3, 5.0)
    assert ld.longest((1, 2, 7)) == ("b", 2, 4.0)  # a tie: the earliest
    assert ld.longest((7, 1)) is None
    ld.wait("w1", "a")
    ld.wait("w2", "a")
    assert ld.gone("w2") and not ld.gone("w2")  # its bound passed: it waits no more
    ld.writing("a", (1, 2, 3), 6.0)  # routed again: its waiters stay
    assert ld.done("a") == ["w1"]
    assert ld.done("a") == [] and not ld.gone("w1")
    assert ld.done("b") == [] and ld.empty()


def _trace(n: int, gap_s: float, user_blocks: int = 1) -> list[Session]:
    bt = HASH_BLOCK_TOKENS
    return [Session(f"s{i}", i * gap_s,
                    (Round(8 * bt + 100, 20, 1.0, None, (*range(1, 8), *(1000 * (i + 1) + k for k in range(user_blocks)))),
                     Round(100, 20))) for i in range(n)]


def test_a_session_arriving_during_the_first_prefill_waits_for_its_blocks_when_that_pays():
    # one decode worker, two prefill workers: a second session prefilling itself runs beside the first
    kw = dict(policy="remote", prefill="tp1*2", decode="tp1*1", ttft_slo_s=10.0, itl_slo_s=1.0)
    prof = _profile(cap=200_000)
    alone = simulate(_trace(1, 0.0), prof, prefix_sharing=True, **kw).sessions[0].rounds[0].ttft
    # arriving halfway through it: the blocks land before its own prefill would be done
    on = simulate(_trace(2, 0.5 * alone), prof, prefix_sharing=True, **kw)
    assert all(s.completed for s in on.sessions)
    assert on.stats["prefix_waits"] == 1 and on.stats["prefix_shared_blocks"] == 7
    assert on.stats["kv_used_end"] == [0] and on.stats["prefix_blocks_held_end"] == 0
    first, second = (s.rounds[0] for s in on.sessions)
    assert first.first_token < second.first_token < second.input_ready + alone  # it began once they landed: sooner
    # a TTFT SLO that prefilling itself meets and waiting would not: it does not wait
    tight = simulate(_trace(2, 0.02 * alone), prof, prefix_sharing=True, **{**kw, "ttft_slo_s": 1.02 * alone})
    assert "prefix_waits" not in tight.stats and tight.stats["prefix_shared_blocks"] == 0
