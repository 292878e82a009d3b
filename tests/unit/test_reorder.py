"""Prefill queues: FCFS, TTFT-aware reordering (Algorithm 2), Continuum priority."""

from itertools import permutations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampd.policy import (
    QUEUES,
    SLO,
    ContinuumQueue,
    FCFSQueue,
    PrefillTask,
    TTFTAwareQueue,
    make_queue,
)


class LinearCost:
    """t_pre = (l_incr + l_hist / 10) / 1000 / tp seconds."""

    def t_pre(self, tp, l_hist, l_incr):
        return (0.001 * l_incr + 0.0001 * l_hist) / tp

    def t_kv(self, tokens, src_tp, dst_tp):
        return 0.00001 * tokens


COST = LinearCost()
SLO_ = SLO(ttft_s=1.5, itl_s=0.1)


def task(sid, l_incr, enq, rnd=1, l_hist=0):
    return PrefillTask(sid, rnd, l_hist, l_incr, enq)


def drain(q, now=0.0):
    out = []
    while len(q):
        out.append(q.pop(now).session_id)
    return out


# ---------------------------------------------------------------- factory

def test_make_queue_names_and_errors():
    assert QUEUES == ("fcfs", "ttft-aware", "continuum")
    assert isinstance(make_queue("fcfs", COST, SLO_, 2), FCFSQueue)
    q = make_queue("ttft-aware", COST, SLO_, 2, window=4)
    assert isinstance(q, TTFTAwareQueue) and q.window == 4 and q.name == "ttft-aware"
    assert isinstance(make_queue("continuum", COST, SLO_, 2), ContinuumQueue)
    with pytest.raises(ValueError, match="unknown prefill queue 'lifo'; valid queues: fcfs, ttft-aware, continuum"):
        make_queue("lifo", COST, SLO_, 2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        make_queue("ttft-aware", COST, SLO_, 2, window=0)


@pytest.mark.parametrize("name", QUEUES)
def test_empty_pop_raises_and_totals(name):
    q = make_queue(name, COST, SLO_, 2)
    with pytest.raises(IndexError):
        q.pop(0.0)
    q.push(task("a", 1000, 0.0))          # 0.5 s at tp 2
    q.push(task("b", 200, 0.0, l_hist=2000))  # (0.2 + 0.2) / 2 = 0.2 s
    assert len(q) == 2 and q
    assert q.predicted_total() == pytest.approx(0.7)
    assert q.predict(task("x", 1000, 0.0)) == pytest.approx(0.5)
    q.pop(0.0)
    q.pop(0.0)
    assert q.predicted_total() == 0.0 and len(q) == 0 and not q


# ---------------------------------------------------------------- FCFS

def test_fcfs_keeps_push_order():
    q = make_queue("fcfs", COST, SLO_, 1)
    for i, n in enumerate([900, 10, 500, 10]):
        q.push(task(f"s{i}", n, 10.0 - i))
    assert [t.session_id for t in q.tasks()] == ["s0", "s1", "s2", "s3"]
    assert drain(q, 100.0) == ["s0", "s1", "s2", "s3"]


# ---------------------------------------------------------------- Algorithm 2

def test_reorder_lets_urgent_short_task_overtake():
    # A: 1.0 s, just enqueued (slack 1.5) ; B: 0.2 s, waited 1.2 s (slack 0.3)
    # FCFS: A done at 1.0 (meets), B at 1.2 (misses) -> S = 1; B first: 0.2 and 1.2 -> S = 2
    q = make_queue("ttft-aware", COST, SLO_, 1)
    q.push(task("A", 1000, 10.0))
    q.push(task("B", 200, 8.8))
    assert q.pop(10.0).session_id == "B"
    assert q.postponements() == (1,)  # A was postponed once
    assert q.pop(10.2).session_id == "A"


def test_start_in_counts_the_wait_for_the_worker():
    # X 0.5 s fresh, Y 0.1 s waited 0.8 s, TTFT 2 s (issue 26). Free now: X first ends Y at
    # 0.8 + 0.6 = 1.4 s, both meet -> FCFS. Free in 1 s: X first ends Y at 2.4 s (a miss) -> Y first.
    slo = SLO(ttft_s=2.0, itl_s=0.1)
    for start_in, first in ((0.0, "X"), (1.0, "Y")):
        q = make_queue("ttft-aware", COST, slo, 1)
        q.push(task("X", 500, 0.0))
        q.push(task("Y", 100, -0.8))
        assert q.pop(0.0, start_in).session_id == first
        assert (q.pops_choice, q.pops_reordered) == (1, int(first == "Y"))
        assert q.pops_on_time == int(first == "X")  # free now, FCFS met both: nothing to gain
        q.pop(0.0)
        assert (q.pops_choice, q.pops_reordered) == (1, int(first == "Y"))  # one task: no choice


@pytest.mark.parametrize("name", QUEUES)
def test_pop_counters(name):
    q = make_queue(name, COST, SLO_, 1)
    q.push(task("a", 1000, 10.0))
    q.push(task("b", 200, 8.8, rnd=0))
    q.push(task("c", 200, 8.8))
    drain(q, 10.0)
    assert q.pops_choice == 2
    # ttft-aware: b, then c (each waited 1.2 s, 0.2 s long) overtake a (1 s, fresh): b, c, a;
    # continuum: a, then c (running sessions) before the new b: only c overtakes
    assert q.pops_reordered == {"fcfs": 0, "ttft-aware": 2, "continuum": 1}[name]


def test_ties_keep_fcfs():
    # everybody meets TTFT in every order -> FCFS
    q = make_queue("ttft-aware", COST, SLO_, 1)
    for i, n in enumerate([300, 100, 200]):
        q.push(task(f"s{i}", n, 0.0))
    assert drain(q, 0.0) == ["s0", "s1", "s2"]
    # everybody misses in every order -> FCFS
    for i, n in enumerate([300, 100, 200]):
        q.push(task(f"t{i}", n, -10.0))
    assert drain(q, 0.0) == ["t0", "t1", "t2"]
    # equal best S for several orders: identity among them -> identity
    q.push(task("u0", 500, 0.0))   # slack 1.5
    q.push(task("u1", 500, -0.9))  # slack 0.6: meets only if first
    # FCFS: u0 0.5 ok, u1 1.0 > 0.6 miss -> 1 ; swapped: u1 0.5 ok, u0 1.0 ok -> 2 (strictly better)
    assert q.pop(0.0).session_id == "u1"
    q.pop(0.0)
    q.push(task("v0", 1600, 0.0))  # can never meet (1.6 > 1.5)
    q.push(task("v1", 100, -1.0))  # slack 0.5: FCFS finishes it at 1.7 (miss), first at 0.1 (meets)
    # FCFS S = 0, swapped S = 1 -> swap
    assert q.pop(0.0).session_id == "v1"
    q.pop(0.0)
    q.push(task("w0", 100, 0.0))   # meets either way
    q.push(task("w1", 1600, 0.0))  # misses either way -> S ties at 1 -> FCFS
    assert drain(q, 0.0) == ["w0", "w1"]


def test_window_limits_lookahead():
    q = make_queue("ttft-aware", COST, SLO_, 1, window=2)
    q.push(task("A", 1000, 0.0))
    q.push(task("B", 1000, 0.0))
    q.push(task("C", 100, -1.4))  # urgent but outside the window of 2
    assert q.pop(0.0).session_id == "A"


def test_window_one_is_fcfs():
    q = make_queue("ttft-aware", COST, SLO_, 1, window=1)
    q.push(task("A", 1000, 10.0))
    q.push(task("B", 200, 8.8))
    assert drain(q, 10.0) == ["A", "B"]


def test_postponement_cap():
    # w = 2: A (long) is overtaken by an urgent short task twice; the third time it must go first.
    q = make_queue("ttft-aware", COST, SLO_, 1, window=2)
    q.push(task("A", 1000, 0.0))
    now = 0.0
    popped = []
    for k in range(3):
        q.push(task(f"u{k}", 100, now - 1.3))  # slack 0.2: meets only when first
        popped.append(q.pop(now).session_id)
        if popped[-1] == "A":
            break
    assert popped == ["u0", "u1", "A"]
    assert q.postponements() == (0,)


def test_task_pushed_behind_window_is_not_postponed():
    q = make_queue("ttft-aware", COST, SLO_, 1, window=3)
    for i, (n, e) in enumerate([(1000, 0.0), (1000, 0.0), (100, -1.4), (1000, 0.0)]):
        q.push(task(f"s{i}", n, e))
    # s2 (urgent) goes first; s0 and s1 each slide one place later -> postponed once; s3 untouched
    assert q.pop(0.0).session_id == "s2"
    assert [t.session_id for t in q.tasks()] == ["s0", "s1", "s3"]
    assert q.postponements() == (1, 1, 0)


# ---------------------------------------------------------------- properties

def _score(order, now, tpre, ttft):
    c = 0.0
    s = 0
    for t in order:
        c += tpre[t.session_id]
        if (now - t.enqueued_at) + c <= ttft:
            s += 1
    return s


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(1, 1500), st.integers(0, 3000), st.floats(0.0, 2.0)),
        st.tuples(st.just("pop"), st.floats(0.0, 0.8)),
    ),
    min_size=1,
    max_size=120,
)


# adversarial mix: long fresh tasks at the head, a stream of urgent short tasks behind them and
# frequent pops, so that the postponement cap is reached and binds
adversarial_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(800, 1500), st.just(0), st.just(0.0)),
        st.tuples(st.just("push"), st.integers(1, 100), st.just(0), st.floats(1.3, 1.5)),
        st.tuples(st.just("pop"), st.floats(0.0, 0.01)),
    ),
    min_size=1,
    max_size=150,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, w=st.integers(1, 5), tp=st.sampled_from([1, 2, 4]))
def test_ttft_aware_properties(ops, w, tp):
    _check_ttft_aware(ops, w, tp)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=adversarial_ops, w=st.integers(2, 5))
def test_ttft_aware_properties_under_postponement_pressure(ops, w):
    _check_ttft_aware(ops, w, 1)


def test_adversarial_stream_reaches_the_cap_and_respects_it():
    # deterministic version of the stream above: the cap must actually bind
    import random

    rng = random.Random(7)
    ops = []
    for _ in range(600):
        r = rng.random()
        if r < 0.1:
            ops.append(("push", rng.randint(800, 1500), 0, 0.0))
        elif r < 0.5:
            ops.append(("push", rng.randint(1, 100), 0, 1.3 + 0.2 * rng.random()))
        else:
            ops.append(("pop", 0.01 * rng.random()))
    for w in (2, 3, 5):
        assert _check_ttft_aware(ops, w, 1) == w


def _check_ttft_aware(ops, w, tp):
    """Run push/pop ``ops`` through a ttft-aware queue and check it against a reference
    Algorithm 2 kept by the test; returns the largest postponement count seen."""
    ttft = SLO_.ttft_s
    q = make_queue("ttft-aware", COST, SLO_, tp, window=w)
    tpre: dict[str, float] = {}
    post: dict[str, int] = {}
    pushed: list[str] = []
    out: list[str] = []
    now = 0.0

    def one_pop():
        before = q.tasks()
        n = min(w, len(before))
        win = before[:n]
        got = q.pop(now)
        assert isinstance(got, PrefillTask)
        after = q.tasks()
        chosen = (got,) + after[: n - 1]
        assert sorted(t.session_id for t in chosen) == sorted(t.session_id for t in win)
        assert after[n - 1:] == before[n:]  # tasks behind the window keep their order
        # the reference Algorithm 2, on the test's own postponement counters
        admissible = []
        for order in permutations(win):
            moved = [t for k, t in enumerate(win) if order.index(t) > k]
            if all(post[t.session_id] < w for t in moved):
                admissible.append((order, moved))
        best = max(_score(o, now, tpre, ttft) for o, _ in admissible)
        s_chosen = _score(chosen, now, tpre, ttft)
        assert s_chosen >= _score(win, now, tpre, ttft)  # never worse than FCFS on the window
        assert s_chosen == best
        first_best = next(o for o, _ in admissible if _score(o, now, tpre, ttft) == best)
        assert chosen == first_best  # ties resolved by enumeration order, identity first
        for k, t in enumerate(win):
            if chosen.index(t) > k:
                post[t.session_id] += 1
                assert post[t.session_id] <= w
        assert q.postponements() == tuple(post[t.session_id] for t in after)
        out.append(got.session_id)

    for op in ops:
        if op[0] == "push":
            _, l_incr, l_hist, age = op
            sid = f"s{len(pushed)}"
            t = PrefillTask(sid, 1, l_hist, l_incr, now - age)
            q.push(t)
            tpre[sid] = COST.t_pre(tp, l_hist, l_incr)
            post[sid] = 0
            pushed.append(sid)
        else:
            now += op[1]
            if len(q):
                one_pop()
        assert q.predicted_total() == pytest.approx(sum(tpre[t.session_id] for t in q.tasks()), abs=1e-9)
    while len(q):
        now += 0.1
        one_pop()
    assert sorted(out) == sorted(pushed) and len(out) == len(pushed)
    most = max(post.values(), default=0)
    assert most <= w
    assert q.predicted_total() == 0.0
    return most


@settings(max_examples=100, deadline=None)
@given(rounds=st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=60))
def test_continuum_running_sessions_first_fcfs_within_class(rounds):
    q = make_queue("continuum", COST, SLO_, 1)
    pushed = []
    out = []
    for i, (rnd, pop) in enumerate(rounds):
        t = task(f"s{i}", 100, float(i), rnd=rnd)
        q.push(t)
        pushed.append(t)
        order = q.tasks()
        assert order == tuple(x for x in order if x.round >= 1) + tuple(x for x in order if x.round == 0)
        if pop:
            out.append(q.pop(float(i)))
    while len(q):
        out.append(q.pop(0.0))
    assert sorted(t.session_id for t in out) == sorted(t.session_id for t in pushed)


def test_continuum_example():
    q = make_queue("continuum", COST, SLO_, 1)
    q.push(task("new1", 100, 0.0, rnd=0))
    q.push(task("old1", 100, 1.0, rnd=2))
    q.push(task("new2", 100, 2.0, rnd=0))
    q.push(task("old2", 100, 3.0, rnd=1))
    assert [t.session_id for t in q.tasks()] == ["old1", "old2", "new1", "new2"]
    assert q.predicted_total() == pytest.approx(0.4)
    assert drain(q) == ["old1", "old2", "new1", "new2"]
