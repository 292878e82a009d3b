"""Unit tests of the decode worker core (ampd/worker/decode.py): hand-computed times on a linear
profile, runs of decode steps and cutting them, chunked local prefill, KV admission (both rules),
eviction of idle sessions' KV (expired pins, --kv-evict), and the published view."""
from __future__ import annotations

import pytest

from ampd.policy import SLO, PrefillTask, make_queue
from ampd.worker import (ADMITTED, FAILED, IDLE, PREFILLING, STEPPING, WAITING, DecodeCore, DecodeRun,
                         DecodeSession, LocalPrefill, steps_done)
from tests.unit.test_worker_prefill import P  # t_pre = 0.01 + 1e-4 l_incr + 1e-6 l_hist; t_dec = 0.02 + 1e-4 b + 1e-7 ctx

SLO_ = SLO(ttft_s=1.0, itl_s=0.1)


def _core(cap=10_000, chunk=0, rule="wait", evict=False, step_by_step=False) -> DecodeCore:
    return DecodeCore("decode-0", 1, P, make_queue("fcfs", P, SLO_, 1), kv_capacity_tokens=cap,
                      chunk_tokens=chunk, kv_admission=rule, kv_evict=evict, step_by_step=step_by_step)


def _sess(sid, l_incr, out, rnd=0) -> DecodeSession:
    s = DecodeSession(sid)
    s.round, s.l_incr, s.out = rnd, l_incr, out
    return s


def _one_token_round(core, s, now, last):
    """A round of one output token ends: its first token is its last."""
    assert core.first_token(s, now) is False
    core.round_end(s, last)


def _local(core, s, now):
    core.submit_local(PrefillTask(s.session_id, s.round, s.l_hist, s.l_incr, now, core.worker_id, 1))


def test_local_prefill_then_a_run_of_steps_by_hand():
    core = _core()
    s = _sess("s", 500, 4)
    assert core.round_ready(s, 0.0) == ADMITTED and core.kv_used == 500
    _local(core, s, 0.0)
    p = core.schedule(0.0)
    assert isinstance(p, LocalPrefill) and p.last and p.tokens == 500
    assert p.seconds == pytest.approx(0.06) and core.state == PREFILLING
    assert core.view(0.02).queue_predicted_s == pytest.approx(0.04)  # the residual of the prefill
    assert core.update(p, 0.06) == (s,)
    assert core.first_token(s, 0.06) and core.kv_used == 501
    r = core.schedule(0.06)
    A = 0.02 + 1e-4 + 501e-7  # batch 1, context 501 (input + first token)
    assert isinstance(r, DecodeRun) and r.steps == 3 and r.batch == 1
    assert r.first_s == pytest.approx(A) and r.growth_s == pytest.approx(1e-7)
    assert r.end == pytest.approx(0.06 + 3 * A + 3e-7)  # steps last A, A + g, A + 2g
    assert core.update(r, r.end) == [s]
    assert core.kv_used == 504
    core.round_end(s, last=True)
    assert core.kv_used == 0 and core.admitted == 0
    assert core.schedule(r.end) is None and core.state == IDLE
    # the window holds the run's 3 gaps; the first runs from the first token
    assert core.view(r.end).window_mean_s == pytest.approx((r.end - 0.06) / 3)


def test_cut_ends_the_run_at_the_next_step_boundary():
    core = _core()
    s = _sess("s", 500, 10)
    core.round_ready(s, 0.0)
    core.first_token(s, 0.0)  # a remote prefill's first token
    r = core.schedule(0.0)
    A, g = r.first_s, r.growth_s
    assert r.steps == 9 and core.state == STEPPING
    ver = core.run_ver
    t = 1.5 * A  # inside step 2
    o = _sess("o", 100, 2)
    core.round_ready(o, t)
    _local(core, o, t)
    end = core.cut(t)
    assert end == pytest.approx(2 * A + g) and core.run_ver == ver + 1
    assert core.cut(t) is None  # already cut
    assert not core.update(r, end)  # its 2 steps
    assert core.step_idx == 2 and core.kv_used == 500 + 1 + 100 + 2
    p = core.schedule(end)
    assert isinstance(p, LocalPrefill) and p.session is o  # prefill priority


def test_steps_done_counts_whole_steps():
    A, g = 0.1, 0.01
    ends = [A, 2 * A + g, 3 * A + 3 * g]
    assert [steps_done(x, A, g, 10) for x in (0.0, ends[0], ends[1] - 1e-9, ends[1], ends[2] + 1e-9)] == [0, 1, 1, 2, 3]
    assert steps_done(100.0, A, g, 5) == 5


def test_chunked_local_prefill_alternates_with_one_decode_step():
    core = _core(chunk=512)
    a = _sess("a", 100, 50)
    core.round_ready(a, 0.0)
    core.first_token(a, 0.0)
    run = core.schedule(0.0)
    b = _sess("b", 1200, 2)
    core.round_ready(b, 0.001)
    _local(core, b, 0.001)
    end = core.cut(0.001)
    core.update(run, end)
    c1 = core.schedule(end)
    assert (c1.tokens, c1.last) == (512, False) and c1.seconds == pytest.approx(0.01 + 0.0512)
    assert core.update(c1, c1.end) == ()
    step = core.schedule(c1.end)
    assert isinstance(step, DecodeRun) and step.steps == 1  # one step of the batch between chunks
    core.update(step, step.end)
    c2 = core.schedule(step.end)
    assert c2.tokens == 512 and c2.seconds == pytest.approx(0.01 + 0.0512 + 512e-6)
    core.update(c2, c2.end)
    step2 = core.schedule(c2.end)
    core.update(step2, step2.end)
    c3 = core.schedule(core.last_end)
    assert (c3.tokens, c3.last) == (176, True) and c3.seconds == pytest.approx(0.01 + 0.0176 + 1024e-6)
    assert core.update(c3, c3.end) == (b,)
    assert run.steps == 49


def test_kv_wait_new_sessions_wait_for_running_ones():
    core = _core(cap=1000)
    s1 = _sess("s1", 600, 1)
    s2 = _sess("s2", 600, 1)
    assert core.round_ready(s1, 0.0) == ADMITTED
    assert core.round_ready(s2, 0.0) == WAITING
    assert core.admit_next(0.0) is None
    assert core.view(0.0).kv_free_tokens == 1000 - 600 - 600  # waiting rounds count as used
    _one_token_round(core, s1, 0.5, last=True)
    assert core.admit_next(1.0) is s2 and core.kv_used == 600 and core.admitted == 1
    assert core.admit_next(1.0) is None


def test_kv_wait_no_deadlock_rule_overcommits():
    core = _core(cap=1000)
    s1 = _sess("s1", 600, 1)
    core.round_ready(s1, 0.0)
    _one_token_round(core, s1, 0.5, last=False)  # history 601
    s1.round, s1.l_incr = 1, 500
    assert core.round_ready(s1, 1.0) == WAITING
    # every running session waits: nobody would free KV, so it goes ahead over capacity
    assert core.admit_next(1.0) is s1 and core.kv_overcommits == 1 and core.kv_used == 1101


def test_kv_fail_rule_fails_the_session_and_frees_its_kv():
    core = _core(cap=1000, rule="fail")
    s1 = _sess("s1", 600, 1)
    s2 = _sess("s2", 600, 1)
    assert core.round_ready(s1, 0.0) == ADMITTED
    assert core.round_ready(s2, 0.0) == FAILED and s2.error.startswith("KV exhausted on decode-0")
    assert core.admitted == 1 and core.kv_used == 600
    _one_token_round(core, s1, 0.5, last=False)
    s1.round, s1.l_incr = 1, 500
    assert core.round_ready(s1, 1.0) == FAILED
    assert core.kv_used == 0 and core.admitted == 0 and not core.sessions


def test_bad_kv_admission_rule_is_named():
    with pytest.raises(ValueError, match="kv_admission"):
        _core(rule="drop")


def test_expired_pin_is_evicted_for_a_round_that_needs_the_room_and_re_prefills():
    core = _core(cap=1000)
    s1 = _sess("s1", 599, 1)
    core.round_ready(s1, 0.0)
    _one_token_round(core, s1, 0.5, last=False)  # history 600
    assert core.tool_call(s1, pin=True) is False
    s2 = _sess("s2", 600, 1)
    assert core.round_ready(s2, 0.8) == WAITING  # the pin holds: nothing to evict
    assert not s1.evicted and core.kv_evictions == 0
    assert core.pin_expired(s1) is True  # a round waits: loop on admit_next
    assert core.admit_next(1.0) is s2 and s1.evicted and core.kv_evictions == 1 and core.victims == [s1]
    s1.round, s1.l_incr = 1, 100
    assert core.round_ready(s1, 2.0) == WAITING  # re-prefills its whole context: 700 tokens
    assert s1.l_incr == 700 and s1.l_hist == 0 and core.kv_recomputed_tokens == 600


def _idle(core, sid, l_incr, now):
    """A session whose first round (one output token) ended; it is in a tool call now."""
    s = _sess(sid, l_incr - 1, 1)
    assert core.round_ready(s, now) == ADMITTED
    _one_token_round(core, s, now, last=False)  # history l_incr
    core.tool_call(s)
    return s


def test_kv_evict_evicts_idle_sessions_least_recently_used_first():
    core = _core(cap=1000, evict=True)
    a, b, c = (_idle(core, sid, 300, t) for sid, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)))
    assert core.kv_used == 900
    n = _sess("n", 600, 1)
    assert core.round_ready(n, 4.0) == ADMITTED  # at once: a and b go, c (idle the shortest) stays
    assert core.victims == [a, b] and a.evicted and b.evicted and not c.evicted
    assert core.kv_used == 300 + 600 and core.kv_evictions == 2
    # a returns: its history is prefilled again, on top of its new input; c makes the room
    a.round, a.l_incr = 1, 50
    assert core.round_ready(a, 5.0) == ADMITTED and core.victims == [c]
    assert a.l_incr == 350 and a.l_hist == 0 and core.kv_recomputed_tokens == 300
    assert core.kv_used == 600 + 350 and not core.evictable


def test_an_evicted_session_frees_only_the_pinned_blocks_it_alone_holds():
    # prefix sharing without the tier (the simulator's --kv-evict): 320 of a's 600 tokens are in
    # blocks the prefix index holds (``pinned``), 160 of them in blocks nobody else holds
    # (``pin_own``): evicting a frees 600 - 160, not the 160 others still read
    core = _core(cap=1000, evict=True)
    a = _idle(core, "a", 600, 1.0)
    a.pinned, a.pin_own = 320, 160
    assert core.round_ready(_sess("n", 900, 1), 2.0) == WAITING  # 1000 - 160 others read < 900
    assert a.evicted and core.take_victims() == [a] and a.pinned == a.pin_own == 0
    assert core.kv_used == 0 and core.kv_cap == 840  # until the driver syncs (live: the pool's count)
    core.sync_kv_free(1000)  # the other holders let go too
    assert core.admit_next(3.0) is not None and core.kv_used == 900


def test_no_idle_session_loses_its_kv_for_a_round_that_would_not_fit_anyway():
    core = _core(cap=1000, evict=True)
    a = _idle(core, "a", 300, 1.0)
    b = _idle(core, "b", 300, 2.0)
    assert core.round_ready(_sess("n", 500, 1), 3.0) == ADMITTED and core.victims == [a]
    assert core.round_ready(_sess("m", 900, 1), 4.0) == WAITING  # 200 free + b's 300 < 900
    assert not b.evicted and core.victims == [] and core.kv_evictions == 1


def test_a_returning_session_is_not_evictable_and_goes_last_after_its_next_round():
    core = _core(cap=1000, evict=True)
    a = _idle(core, "a", 300, 1.0)
    b = _idle(core, "b", 300, 2.0)
    a.round, a.l_incr, a.out = 1, 99, 1
    assert core.round_ready(a, 3.0) == ADMITTED and list(core.evictable) == [b]
    n = _sess("n", 500, 1)
    assert core.round_ready(n, 3.5) == ADMITTED and core.victims == [b]  # not a: it is in a round
    _one_token_round(core, a, 4.0, last=False)
    assert core.tool_call(a) is False and list(core.evictable) == [a]


def test_a_session_entering_a_tool_call_lets_a_waiting_round_in():
    core = _core(cap=1000, evict=True)
    a = _sess("a", 599, 1)
    core.round_ready(a, 0.0)
    n = _sess("n", 600, 1)
    assert core.round_ready(n, 0.1) == WAITING  # a is in its round: not evictable
    _one_token_round(core, a, 0.5, last=False)
    assert core.tool_call(a) is True  # evictable, and a round waits
    assert core.admit_next(0.5) is n and core.victims == [a]


def test_without_kv_evict_idle_sessions_keep_their_kv():
    core = _core(cap=1000)
    _idle(core, "a", 600, 1.0)
    n = _sess("n", 600, 1)
    assert core.round_ready(n, 2.0) == WAITING and core.admit_next(2.0) is None
    assert core.kv_evictions == 0 and not core.evictable


def test_kv_evict_with_the_fail_rule_evicts_before_failing():
    core = _core(cap=1000, rule="fail", evict=True)
    a = _idle(core, "a", 600, 1.0)
    n = _sess("n", 600, 1)
    assert core.round_ready(n, 2.0) == ADMITTED and a.evicted
    big = _sess("big", 900, 1)
    assert core.round_ready(big, 3.0) == FAILED  # nothing left to evict


def test_dropped_idle_session_leaves_the_evictable_set_and_an_evicted_one_frees_nothing_more():
    core = _core(cap=1000, evict=True)
    a = _idle(core, "a", 300, 1.0)
    b = _idle(core, "b", 300, 2.0)
    assert core.drop(a) is True and list(core.evictable) == [b] and core.kv_used == 300
    assert core.round_ready(_sess("n", 900, 1), 3.0) == ADMITTED and b.evicted
    assert core.drop(b) is False and core.kv_used == 900


def test_make_room_evicts_until_the_tokens_fit():
    core = _core(cap=1000, evict=True)
    a = _idle(core, "a", 300, 1.0)
    b = _idle(core, "b", 300, 2.0)
    assert core.make_room(400) is True and core.victims == []  # 400 free already
    assert core.make_room(500) is True and core.victims == [a]
    assert core.make_room(1001) is False and core.victims == [] and core.kv_used == 300  # b keeps its KV
    assert core.make_room(1000) is True and core.victims == [b] and core.kv_used == 0


def test_an_evicted_session_rewound_between_rounds_re_prefills_what_it_keeps():
    core = _core(cap=1000, evict=True)
    a = _idle(core, "a", 600, 1.0)
    core.round_ready(_sess("n", 600, 1), 2.0)
    assert a.evicted
    core.rewind(a, 200)  # an edited conversation keeps 200 tokens: nothing charged to release
    assert core.kv_used == 600
    a.round, a.l_incr = 1, 50
    assert core.round_ready(a, 3.0) == ADMITTED and a.l_incr == 250 and core.kv_recomputed_tokens == 200
    assert core.kv_used == 850


def test_stop_early_takes_a_session_out_of_the_batch():
    core = _core()
    a = _sess("a", 100, 10)
    b = _sess("b", 200, 5)
    for s in (a, b):
        core.round_ready(s, 0.0)
        core.first_token(s, 0.0)
    r = core.schedule(0.0)
    assert r.batch == 2 and r.steps == 4  # up to b's exit
    core.cut(0.0)  # live: one step at a time
    assert not core.update(r, r.first_s)
    with pytest.raises(ValueError, match="not in the batch"):
        core.stop_early(_sess("x", 1, 3), 2)
    core.stop_early(a, 2)  # EOS after its second token
    assert core.batch_size == 1 and core.ctx_sum == 201 + 1 and a.out == 2
    core.round_end(a, last=True)
    assert core.kv_used == 200 + 1 + 1  # a released 100 + 2 tokens; b holds input, first token, 1 step
    r2 = core.schedule(r.first_s)
    assert r2.batch == 1 and r2.steps == 3  # b's remaining steps


def test_view_cached_during_a_local_prefill_does_not_outlive_its_residual():
    # live: a local prefill running past its predicted end keeps the worker PREFILLING; a view
    # read then shows no residual, not the one cached mid-prefill
    core = _core()
    s = _sess("s", 500, 4)
    core.round_ready(s, 0.0)
    _local(core, s, 0.0)
    core.schedule(0.0)  # prefill until 0.06
    assert core.view(0.02).queue_predicted_s == pytest.approx(0.04)
    assert core.state == PREFILLING and core.view(0.07).queue_predicted_s == 0.0


@pytest.mark.parametrize("rule", ["wait", "fail"])
def test_a_shared_prefix_is_the_history_charged_at_admission_and_released_with_it(rule):
    core = _core(cap=1000, rule=rule)
    s = _sess("a", 100, 5)
    core.shared_history(s, 512)  # --prefix-sharing: 512 tokens of KV shared with other sessions
    assert s.l_hist == 512 and core.kv_used == 0  # nothing charged before admission
    assert core.round_ready(s, 0.0) == ADMITTED and core.kv_used == 612
    core.kv_used += s.out  # its output, charged by the decode steps (not run here)
    core.round_end(s, True)
    assert core.kv_used == 0 and not core.sessions
    w = _sess("w", 2000, 5)  # too big: waits (or fails) with its shared prefix never charged
    core.shared_history(w, 64)
    assert core.round_ready(w, 0.0) in (WAITING, FAILED)
    core.drop(w)
    assert core.kv_used == 0
    with pytest.raises(ValueError):
        b = _sess("b", 10, 1)
        core.round_ready(b, 0.0)
        core.shared_history(b, 32)  # after its start: refused
