"""The coordinator's view of a worker ages the in-service prefill's remaining time between publishes."""
from __future__ import annotations

import time

import pytest

from ampd.state import WorkerStats
from ampd.state.store import age_view
from ampd.state.cluster import Cluster, StatsEntry, RoutedTask


def stats(ts: float, predicted: float, busy_until: float) -> WorkerStats:
    return WorkerStats("prefill-0", ts, 1.0, (("s", 0, 0, 100, ts - 1.0),), predicted, 1000,
                       busy_until=busy_until)


def test_stats_json_round_trip_keeps_busy_until():
    st = stats(100.0, 2.5, 101.5)
    back = WorkerStats.from_json(st.to_json())
    assert back == st
    # Published by an older worker (no busy_until): nothing to age.
    raw = st.to_json().replace(',"busy_until":101.5', "")
    assert WorkerStats.from_json(raw).busy_until == 0.0


@pytest.mark.parametrize("now, expected", [
    (100.0, 2.5),   # at the publish: as published (1.0 queued + 1.5 in service)
    (100.4, 2.1),   # 0.4 s later: 1.1 s left in service
    (101.5, 1.0),   # the prefill in service is due: only the queued task
    (103.0, 1.0),   # overdue: never below the queued work
])
def test_age_view_shrinks_only_the_in_service_part(now, expected):
    st = stats(100.0, 2.5, 101.5)
    v = age_view(st.view("prefill", 1), st.ts, st.busy_until, now)
    assert v.queue_predicted_s == pytest.approx(expected)
    assert v.queue == st.view("prefill", 1).queue and v.window_mean_s == 1.0


def test_age_view_without_a_prefill_in_service_is_the_published_view():
    st = stats(100.0, 1.0, 0.0)
    v0 = st.view("prefill", 1)
    assert age_view(v0, st.ts, st.busy_until, 100.3) is v0


def test_cluster_view_ages_pushed_stats():
    now = time.time()
    st = stats(now - 0.3, 2.5, now + 1.2)  # published 0.3 s ago with 1.5 s in service
    entries = [StatsEntry(st.ts, "prefill", st.view("prefill", 1), st.busy_until, st.accepted)]
    view = Cluster(store=None)._assemble(entries, 0.0)
    (p,) = view.prefill
    assert p.queue_predicted_s == pytest.approx(2.2, abs=0.05)


class FlatCost:
    """t_pre: 1 ms per incremental token per TP-less unit (the routed note only prices compute)."""

    def t_pre(self, tp: int, l_hist: int, l_incr: int) -> float:
        return l_incr * 1e-3 / tp


def test_stats_from_a_newer_worker_skip_fields_this_version_does_not_know():
    st = stats(100.0, 2.5, 101.5)
    raw = st.to_json()[:-1] + ',"some_later_field":[1,2]}'
    assert WorkerStats.from_json(raw) == st


def test_stats_json_round_trip_keeps_accepted():
    st = WorkerStats("prefill-0", 1.0, None, (), 0.0, 0, accepted=(("s", 1), ("t", 0)))
    assert WorkerStats.from_json(st.to_json()) == st


def test_a_routed_task_counts_until_its_worker_names_it():
    from ampd.policy import PrefillTask, RouteDecision

    now = time.time()
    c = Cluster(store=None, cost=FlatCost())
    pre = WorkerStats("prefill-0", now, None, (), 0.5, 1000)
    dec = WorkerStats("decode-0", now, None, (), 0.0, 1000)

    def entries(p=pre, d=dec):
        return [StatsEntry(p.ts, "prefill", p.view("prefill", 2), p.busy_until, p.accepted),
                StatsEntry(d.ts, "decode", d.view("decode", 1), d.busy_until, d.accepted)]

    view = c._assemble(entries(), 0.0)
    a = PrefillTask("a", 0, 0, 400, now, "decode-0", 1)
    c.routed(view, a, RouteDecision("prefill-0", False, "prefill-slack"), now)
    b = PrefillTask("b", 3, 100, 300, now, "decode-0", 1)
    c.routed(view, b, RouteDecision("decode-0", True, "decode-slack"), now)
    view = c._assemble(entries(), 0.0)
    # a's compute at the prefill worker's TP 2, b's at the decode worker's TP 1, on top of the published
    assert view.prefill[0].queue_predicted_s == pytest.approx(0.5 + 0.2)
    assert view.decode["decode-0"].queue_predicted_s == pytest.approx(0.3)
    # A publication that does not name a's task (taken before it arrived) keeps it counted ...
    pre2 = WorkerStats("prefill-0", now + 0.001, None, (), 0.5, 1000, accepted=(("z", 0),))
    assert c._assemble(entries(pre2), 0.0).prefill[0].queue_predicted_s == pytest.approx(0.7)
    # ... the one that names it counts it itself.
    pre3 = WorkerStats("prefill-0", now + 0.002, None, (), 0.9, 1000, accepted=(("z", 0), ("a", 0)))
    view = c._assemble(entries(pre3), 0.0)
    assert view.prefill[0].queue_predicted_s == pytest.approx(0.9)
    assert view.decode["decode-0"].queue_predicted_s == pytest.approx(0.3)
    # A route that never reached its worker stops counting after ROUTED_TTL_S.
    from ampd.state.cluster import ROUTED_TTL_S

    c._routed[("b", 3)] = RoutedTask("decode-0", now - ROUTED_TTL_S - 0.01, 0.3)
    assert c._assemble(entries(pre3), 0.0).decode["decode-0"].queue_predicted_s == 0.0
    assert not c._routed


def test_without_a_cost_model_nothing_is_noted():
    from ampd.policy import PrefillTask, RouteDecision

    c = Cluster(store=None)
    st = WorkerStats("decode-0", time.time(), None, (), 0.0, 1000)
    view = c._assemble([StatsEntry(st.ts, "decode", st.view("decode", 1), 0.0, ())], 0.0)
    c.routed(view, PrefillTask("a", 0, 0, 10, 0.0, "decode-0", 1), RouteDecision("decode-0", True, "x"), 0.0)
    assert not c._routed


def test_routed_tasks_count_once_each_and_expire_oldest_first():
    from ampd.policy import PrefillTask, RouteDecision
    from ampd.state.cluster import ROUTED_TTL_S

    now = time.time()
    c = Cluster(store=None, cost=FlatCost())
    dec = WorkerStats("decode-0", now, None, (), 0.0, 1000)
    entries = [StatsEntry(dec.ts, "decode", dec.view("decode", 1), 0.0, ())]
    view = c._assemble(entries, 0.0)
    for i in range(100):  # 100 ms of compute each, routed 10 ms apart
        c.routed(view, PrefillTask(f"s{i}", 1, 0, 100, now, "decode-0", 1), RouteDecision("decode-0", True, "x"),
                 now - ROUTED_TTL_S - 0.505 + i * 0.01)
    # routed again: it counts once, from then
    c.routed(view, PrefillTask("s0", 1, 0, 100, now, "decode-0", 1), RouteDecision("decode-0", True, "x"), now)
    # s1 to s50 are past the TTL now (s0, routed again, is not)
    assert c._assemble(entries, 0.0).decode["decode-0"].queue_predicted_s == pytest.approx(0.1 * 50)
    assert len(c._routed) == 50 and ("s0", 1) in c._routed
    for key in list(c._routed):
        c._drop(key)
    assert c._routed_s == {} and c._routed_n == {}
    assert c._assemble(entries, 0.0).decode["decode-0"].queue_predicted_s == 0.0
