"""The coordinator's view of a worker ages the in-service prefill's remaining time between publishes."""
from __future__ import annotations

import time

import pytest

from ampd.state import WorkerStats
from ampd.state.store import age_view
from ampd.state.cluster import Cluster


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
    entries = [(st.ts, "prefill", st.view("prefill", 1), st.busy_until)]
    view = Cluster(store=None)._assemble(entries, 0.0)
    (p,) = view.prefill
    assert p.queue_predicted_s == pytest.approx(2.2, abs=0.05)
