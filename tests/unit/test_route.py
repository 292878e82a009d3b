"""Routing: Algorithm 1 (adaptive) and the baseline routers."""

import pytest

from ampd.policy import (
    COST_MODEL,
    DECODE_SLACK,
    NO_PREFILL_WORKERS,
    POLICIES,
    PREFILL_SLACK,
    ROUTERS,
    SLO,
    AdaptiveRouter,
    LocalRouter,
    PrefillTask,
    RemoteRouter,
    MARGIN_LOCAL,
    MARGIN_REMOTE,
    MarginRouter,
    ThresholdRouter,
    WorkerView,
    make_router,
)


class LinearCost:
    """t_pre = (1 ms * l_incr + 0.1 ms * l_hist) / tp;  t_kv = 10 us per token."""

    def t_pre(self, tp, l_hist, l_incr):
        return (0.001 * l_incr + 0.0001 * l_hist) / tp

    def t_kv(self, tokens, src_tp, dst_tp):
        return 0.00001 * tokens


class NoKvCost(LinearCost):
    def t_kv(self, tokens, src_tp, dst_tp):
        return 0.0


SLO_ = SLO(ttft_s=2.0, itl_s=0.1)  # alpha=0.5 -> TTFT limit 1.0; beta=0.5 -> ITL limit 0.05
REQ = PrefillTask("s1", 1, l_hist=2000, l_incr=500, decode_worker="d0")


def pw(wid, window, tp=4, q=0.0):
    return WorkerView(wid, "prefill", tp, window, (), 0, q)


def dw(window, tp=2, q=0.0, wid="d0"):
    return WorkerView(wid, "decode", tp, window, (), 10_000, q)


def adaptive(seed=0, cost=None):
    return AdaptiveRouter(cost or LinearCost(), SLO_, seed=seed, alpha=0.5, beta=0.5)


def visiting_order(seed, prefills):
    """The seeded visiting order of a fresh router, read from a decision where every prefill
    worker is busy (all of them are visited and their windows recorded in visit order)."""
    busy = [pw(p.worker_id, 5.0, p.tp, p.queue_predicted_s) for p in prefills]
    d = adaptive(seed).route(REQ, dw(0.01), busy, 0.0)
    assert d.reason == DECODE_SLACK
    return [k.split(":", 1)[1] for k in d.estimates if k.startswith("ttft_window:")]


# ---------------------------------------------------------------- rung 1: prefill slack

def test_first_slack_worker_in_visiting_order_wins_and_busy_ones_are_skipped():
    ids = [f"p{i}" for i in range(6)]
    for seed in range(20):
        order = visiting_order(seed, [pw(i, None) for i in ids])
        assert sorted(order) == ids
        # only the 2nd and 4th visited workers have slack: the 2nd visited must win
        slack = {order[1], order[3]}
        prefills = [pw(i, 0.9 if i in slack else 1.5) for i in ids]
        d = adaptive(seed).route(REQ, dw(1.0), prefills, 0.0)
        assert (d.target, d.local, d.reason) == (order[1], False, PREFILL_SLACK)
        assert d.estimates["ttft_limit"] == pytest.approx(1.0)
        visited = [k for k in d.estimates if k.startswith("ttft_window:")]
        assert visited == [f"ttft_window:{order[0]}", f"ttft_window:{order[1]}"]
        assert d.estimates[f"ttft_window:{order[0]}"] == 1.5


def test_window_equal_to_limit_counts_as_slack():
    d = adaptive().route(REQ, dw(1.0), [pw("p0", 1.0)], 0.0)  # limit = 0.5 * 2.0 = 1.0
    assert (d.target, d.reason) == ("p0", PREFILL_SLACK)


def test_none_window_counts_as_slack():
    prefills = [pw("p0", 1.5), pw("p1", None), pw("p2", 1.7)]
    d = adaptive(3).route(REQ, dw(1.0), prefills, 0.0)
    assert (d.target, d.local, d.reason) == ("p1", False, PREFILL_SLACK)
    # every worker visited before the winner was busy
    assert all(v > 1.0 for k, v in d.estimates.items() if k.startswith("ttft_window:"))


def test_only_slack_worker_always_wins_whatever_the_seed():
    prefills = [pw("p0", 1.5), pw("p1", 1.2), pw("p2", 0.3), pw("p3", 9.0)]
    r = adaptive(11)
    for _ in range(50):
        assert r.route(REQ, dw(1.0), prefills, 0.0).target == "p2"


# ---------------------------------------------------------------- rung 2: decode slack

def test_decode_slack_when_every_prefill_worker_is_busy():
    prefills = [pw("p0", 1.5), pw("p1", 1.01)]
    d = adaptive().route(REQ, dw(0.05), prefills, 0.0)  # ITL limit 0.5 * 0.1 = 0.05
    assert (d.target, d.local, d.reason) == ("d0", True, DECODE_SLACK)
    assert d.estimates["itl_limit"] == pytest.approx(0.05)
    assert d.estimates["itl_window"] == 0.05
    assert d.estimates["ttft_window:p0"] == 1.5 and d.estimates["ttft_window:p1"] == 1.01
    assert "t_local" not in d.estimates


def test_decode_none_window_counts_as_slack():
    d = adaptive().route(REQ, dw(None), [pw("p0", 1.5)], 0.0)
    assert (d.target, d.local, d.reason) == ("d0", True, DECODE_SLACK)
    assert "itl_window" not in d.estimates


# ---------------------------------------------------------------- rung 3: cost model

def test_cost_model_picks_a_specific_remote():
    # t_local     = (0.5 + 0.2)/2 + 0.5           = 0.85
    # t_remote:p1 = (0.5 + 0.2)/4 + 0.025 + 0.1   = 0.3    (KV: 2000 in + 500 out, 10 us/token)
    # t_remote:p2 = (0.5 + 0.2)/2 + 0.025 + 0.0   = 0.375
    # t_remote:p3 = (0.5 + 0.2)/4 + 0.025 + 0.5   = 0.7
    prefills = [pw("p3", 1.5, 4, 0.5), pw("p1", 1.5, 4, 0.1), pw("p2", 1.5, 2, 0.0)]
    d = adaptive().route(REQ, dw(0.2, tp=2, q=0.5), prefills, 0.0)
    assert (d.target, d.local, d.reason) == ("p1", False, COST_MODEL)
    e = d.estimates
    assert e["t_local"] == pytest.approx(0.85)
    assert e["t_remote:p1"] == pytest.approx(0.3)
    assert e["t_remote:p2"] == pytest.approx(0.375)
    assert e["t_remote:p3"] == pytest.approx(0.7)
    assert e["itl_window"] == 0.2 and e["itl_limit"] == pytest.approx(0.05)


def test_cost_model_picks_local():
    # t_local = 0.35; t_remote:p1 = 0.175 + 0.025 + 0.2 = 0.4; t_remote:p2 = 0.35 + 0.025 + 0.1 = 0.475
    prefills = [pw("p1", 1.5, 4, 0.2), pw("p2", 1.5, 2, 0.1)]
    d = adaptive().route(REQ, dw(0.2, tp=2, q=0.0), prefills, 0.0)
    assert (d.target, d.local, d.reason) == ("d0", True, COST_MODEL)
    assert d.estimates["t_local"] == pytest.approx(0.35)
    assert d.estimates["t_remote:p1"] == pytest.approx(0.4)
    assert d.estimates["t_remote:p2"] == pytest.approx(0.475)


def test_cost_model_ties_go_local_then_lowest_id():
    # no KV cost, same tp, same queue: local and both remotes all cost 0.35
    prefills = [pw("pb", 1.5, 2, 0.25), pw("pa", 1.5, 2, 0.25)]
    d = adaptive(cost=NoKvCost()).route(REQ, dw(0.2, tp=2, q=0.25), prefills, 0.0)
    assert (d.target, d.reason) == ("d0", COST_MODEL)
    d = adaptive(cost=NoKvCost()).route(REQ, dw(0.2, tp=2, q=0.5), prefills, 0.0)
    assert (d.target, d.local) == ("pa", False)
    d = adaptive(cost=NoKvCost()).route(REQ, dw(0.2, tp=2, q=0.5), prefills[::-1], 0.0)
    assert d.target == "pa"


def test_initial_prefill_has_no_history_transfer():
    req = PrefillTask("s2", 0, l_hist=0, l_incr=1000, decode_worker="d0")
    d = adaptive().route(req, dw(0.2, tp=2, q=1.0), [pw("p1", 1.5, 4, 0.0)], 0.0)
    assert d.estimates["t_remote:p1"] == pytest.approx(0.25 + 0.01)  # t_pre + new KV back only
    assert d.target == "p1"


def test_no_prefill_workers_goes_local():
    d = adaptive().route(REQ, dw(9.0), [], 0.0)
    assert (d.target, d.local, d.reason) == ("d0", True, NO_PREFILL_WORKERS)


# ---------------------------------------------------------------- determinism

def _mixed_workers(k):
    # rotate the load so decisions go through every rung
    return [pw(f"p{i}", None if (i + k) % 5 == 0 else (0.5 if (i + k) % 3 == 0 else 1.5), 4, 0.1 * i)
            for i in range(8)]


def test_seeded_decision_sequence_repeats_exactly():
    def run(seed):
        r = adaptive(seed)
        out = []
        for k in range(200):
            prefills = _mixed_workers(k) if k % 4 else [pw(f"p{i}", 1.5, 4, 0.1 * i) for i in range(8)]
            d = r.route(REQ, dw(0.2 if k % 8 == 0 else 0.01), prefills, float(k))
            out.append((d.target, d.reason, tuple(d.estimates.items())))
        return out

    a, b = run(42), run(42)
    assert a == b
    assert {r for _, r, _ in a} == {PREFILL_SLACK, DECODE_SLACK, COST_MODEL}
    assert run(43) != a


def test_other_seed_visits_in_another_order():
    ids = [pw(f"p{i}", None) for i in range(8)]
    r1, r1b, r2 = adaptive(1), adaptive(1), adaptive(2)
    s1 = [r1.route(REQ, dw(0.0), ids, 0.0).target for _ in range(40)]
    s1b = [r1b.route(REQ, dw(0.0), ids, 0.0).target for _ in range(40)]
    s2 = [r2.route(REQ, dw(0.0), ids, 0.0).target for _ in range(40)]
    assert s1 == s1b
    assert s1 != s2
    assert len(set(s1)) > 1  # the random order spreads load
    assert visiting_order(1, ids) != visiting_order(2, ids)


# ---------------------------------------------------------------- baselines

def test_remote_picks_least_loaded_ties_lowest_id():
    r = RemoteRouter()
    prefills = [pw("p2", 0.0, 4, 0.3), pw("p1", 9.0, 4, 0.1), pw("p0", 0.0, 4, 0.2)]
    d = r.route(REQ, dw(0.0), prefills, 0.0)
    assert (d.target, d.local, d.reason) == ("p1", False, "policy-remote")
    assert d.estimates == {"queue_s:p2": 0.3, "queue_s:p1": 0.1, "queue_s:p0": 0.2}
    tie = [pw("pc", 0.0, 4, 0.1), pw("pb", 0.0, 4, 0.1), pw("pd", 0.0, 4, 0.1)]
    assert r.route(REQ, dw(0.0), tie, 0.0).target == "pb"
    assert r.route(REQ, dw(0.0), [], 0.0).reason == NO_PREFILL_WORKERS


def test_local_router_always_local():
    d = LocalRouter().route(REQ, dw(9.0), [pw("p0", None)], 0.0)
    assert (d.target, d.local, d.reason) == ("d0", True, "policy-local")


def test_threshold_router():
    r = ThresholdRouter()  # default 1000 tokens
    prefills = [pw("p1", None, 4, 0.4), pw("p0", None, 4, 0.2)]
    short = PrefillTask("s", 3, l_hist=50_000, l_incr=999, decode_worker="d0")
    long = PrefillTask("s", 3, l_hist=0, l_incr=1000, decode_worker="d0")
    d = r.route(short, dw(9.0), prefills, 0.0)
    assert (d.target, d.local, d.reason) == ("d0", True, "threshold-local")
    assert d.estimates["l_incr"] == 999 and d.estimates["threshold_tokens"] == 1000
    d = r.route(long, dw(0.0), prefills, 0.0)
    assert (d.target, d.local, d.reason) == ("p0", False, "threshold-remote")
    assert make_router("threshold", LinearCost(), SLO_, threshold_tokens=2000).route(
        long, dw(0.0), prefills, 0.0).reason == "threshold-local"
    assert r.route(long, dw(0.0), [], 0.0).reason == NO_PREFILL_WORKERS


# ---------------------------------------------------------------- margin routing

def margin(cost=None):
    return MarginRouter(cost or LinearCost(), SLO_, alpha=0.5, beta=0.5, horizon_s=10.0)


def test_margin_goes_local_when_local_costs_nothing_the_slo_counts():
    # Algorithm 1 sends this prefill remote (an idle prefill worker has slack); locally it is faster
    # (no KV moves) and the decode worker's ITL stays within beta * ITL SLO: margin routing keeps it local.
    idle = [pw("p0", None, tp=2)]
    assert adaptive().route(REQ, dw(0.01), idle, 0.0).reason == PREFILL_SLACK
    d = margin().route(REQ, dw(0.01), idle, 0.0)
    assert (d.local, d.reason) == (True, MARGIN_LOCAL)
    # t_pre(tp 2) = 0.35 s; itl_after = 0.01 * (1 + 0.35 / 10)
    assert d.estimates["itl_after"] == pytest.approx(0.01 * 1.035)


def test_margin_picks_the_shorter_ttft_while_the_itl_holds():
    # the decode worker has a backlog: the prefill worker predicts the shorter TTFT
    d = margin().route(REQ, dw(0.01, q=2.0), [pw("p0", None, tp=2), pw("p1", None, tp=2, q=0.1)], 0.0)
    assert (d.target, d.local, d.reason) == ("p0", False, MARGIN_REMOTE)


def test_margin_protects_the_itl():
    # the decode worker's ITL is near its limit (0.05): a local prefill would push it over -> remote,
    # even though local is faster
    d = margin().route(REQ, dw(0.049), [pw("p0", 5.0, tp=2, q=0.5)], 0.0)
    assert d.estimates["t_local"] < d.estimates["t_remote:p0"]
    assert (d.local, d.reason) == (False, MARGIN_REMOTE)


def test_margin_weighs_both_margins_when_both_sides_are_short():
    # ITL over its limit, remote over the TTFT limit: the larger of the smaller normalised margins
    far = [pw("p0", 5.0, tp=2, q=1.9)]
    d = margin().route(REQ, dw(0.06), far, 0.0)       # local: ITL margin ~0.38 > remote TTFT margin ~-0.1
    assert (d.local, d.reason) == (True, COST_MODEL)
    d = margin().route(REQ, dw(0.2), [pw("p0", 5.0, tp=2, q=1.2)], 0.0)  # ITL margin < 0: remote
    assert (d.local, d.reason) == (False, COST_MODEL)
    assert d.estimates["margin_local"] < d.estimates["margin_remote"]
    assert margin().route(REQ, dw(0.2), [], 0.0).reason == NO_PREFILL_WORKERS
    with pytest.raises(ValueError, match="horizon_s"):
        MarginRouter(LinearCost(), SLO_, horizon_s=0)


# ---------------------------------------------------------------- factory and errors

def test_make_router_by_router_and_policy_name():
    cost = LinearCost()
    kinds = {"ampd": "adaptive", "ampd-window": "adaptive", "ampd-noreorder": "adaptive", "ampd-margin": "margin",
             "remote": "remote", "local": "local",
             "threshold": "threshold", "colocated": "local", "continuum": "local", "ampd-colocated": "adaptive"}
    assert set(kinds) == set(POLICIES)
    for name, kind in kinds.items():
        assert make_router(name, cost, SLO_).name == kind
    for kind in ROUTERS:
        assert make_router(kind, cost, SLO_).name == kind
    r = make_router("ampd", cost, SLO_, seed=5, alpha=0.7, beta=0.6)
    assert (r.alpha, r.beta, r.seed) == (0.7, 0.6, 5)


def test_make_router_errors():
    with pytest.raises(ValueError, match=r"unknown router 'nope'.*adaptive, remote, local, threshold.*ampd, ampd-window, ampd-noreorder"):
        make_router("nope", LinearCost(), SLO_)
    with pytest.raises(ValueError, match="unknown option.*gamma"):
        make_router("ampd", LinearCost(), SLO_, gamma=1)
    with pytest.raises(ValueError, match="alpha"):
        make_router("ampd", LinearCost(), SLO_, alpha=0)
    with pytest.raises(ValueError, match="threshold_tokens"):
        make_router("threshold", LinearCost(), SLO_, threshold_tokens=-1)


def test_route_rejects_a_decode_view_of_another_worker():
    for r in (adaptive(), RemoteRouter(), LocalRouter(), ThresholdRouter()):
        with pytest.raises(ValueError, match="bound to 'd0'.*'d9'"):
            r.route(REQ, dw(0.0, wid="d9"), [pw("p0", None)], 0.0)


# --- slack="queue": our extension; the task's own predicted TTFT must fit as well ---------------

def queue_aware(seed=0):
    return AdaptiveRouter(LinearCost(), SLO_, seed=seed, alpha=0.5, beta=0.5, slack="queue")


def test_queue_slack_skips_a_prefill_worker_whose_backlog_breaks_the_ttft_limit():
    # Both windows are within alpha * TTFT (1.0 s). p0's queue makes Eq. (2) 0.9 + 0.175 + 0.02 +
    # 0.005 = 1.1 s > 1.0 s; p1's is 0.2 s. The paper's rule may pick p0; ours must pick p1.
    prefills = [pw("p0", 0.2, q=0.9), pw("p1", 0.2, q=0.0)]
    for seed in range(20):
        d = queue_aware(seed).route(REQ, dw(0.01), prefills, 0.0)
        assert (d.target, d.local, d.reason) == ("p1", False, PREFILL_SLACK)
        assert d.estimates["t_remote:p1"] == pytest.approx(0.175 + 0.02 + 0.005)
    picks = {adaptive(seed).route(REQ, dw(0.01), prefills, 0.0).target for seed in range(20)}
    assert picks == {"p0", "p1"}  # the window-only rule cannot tell them apart


def test_queue_slack_sends_to_decode_only_when_the_local_queue_fits():
    prefills = [pw("p0", 0.2, q=5.0), pw("p1", 0.2, q=5.0)]  # both backlogged
    d = queue_aware().route(REQ, dw(0.01, q=0.0), prefills, 0.0)  # t_local = 0.35 s
    assert (d.target, d.local, d.reason) == ("d0", True, DECODE_SLACK)
    assert d.estimates["t_local"] == pytest.approx(0.35)
    d = queue_aware().route(REQ, dw(0.01, q=0.8), prefills, 0.0)  # t_local = 1.15 s > 1.0 s
    assert d.reason == COST_MODEL and d.local  # still the cheapest: 1.15 < 5.2
    assert d.estimates["t_remote:p0"] == pytest.approx(5.2)


def test_ampd_policy_uses_queue_slack_and_the_paper_rule_stays_available():
    assert make_router("ampd", LinearCost(), SLO_).slack == "queue"
    assert make_router("ampd-noreorder", LinearCost(), SLO_).slack == "queue"
    assert make_router("ampd", LinearCost(), SLO_, slack="window").slack == "window"
    assert make_router("adaptive", LinearCost(), SLO_).slack == "window"
    with pytest.raises(ValueError, match="slack"):
        make_router("ampd", LinearCost(), SLO_, slack="psychic")


# ----------------------------------------------------------------- the KV's location (host tier)
def _kv(state, fetch_s, **kw):
    from dataclasses import replace
    return replace(REQ, kv_state=state, kv_fetch_s=fetch_s, **kw)


def test_kv_location_constants_are_the_tier_states():
    from ampd.policy.kvtier import KVState
    from ampd.policy.types import KV_GONE, KV_HOST, KV_RESIDENT
    assert (KV_RESIDENT, KV_HOST, KV_GONE) == tuple(s.value for s in KVState)
    assert REQ.kv_state == KV_RESIDENT and REQ.kv_fetch_s == 0.0  # without a tier: as before


def test_kv_on_host_local_pays_the_fetch_remote_overlaps_it():
    """Rung 3: local Eq. (1) = 0.35 + 0.1 queue; remote Eq. (2) = 0.175 + read 0.02 + write 0.005 + 0.3
    queue = 0.5. Resident: local. On host with a 0.2 s fetch: local 0.65, remote max(0.5, 0.2): remote."""
    r = adaptive()
    d, p = dw(0.5, q=0.1), [pw("p0", 5.0, q=0.3)]
    assert r.route(REQ, d, p, 0.0).local
    dec = r.route(_kv("host", 0.2), d, p, 0.0)
    assert (dec.target, dec.reason) == ("p0", COST_MODEL + "+kv-host")
    assert dec.estimates["t_local"] == pytest.approx(0.65) and dec.estimates["t_remote:p0"] == pytest.approx(0.5)
    assert dec.estimates["kv_fetch_s"] == 0.2
    # a fetch longer than the remote prefill: the remote round waits for it too
    dec = r.route(_kv("host", 0.6), d, p, 0.0)
    assert dec.estimates["t_remote:p0"] == 0.6 and dec.target == "p0"


def test_kv_on_host_decode_slack_holds_only_if_the_fetch_keeps_the_ttft():
    r = adaptive()
    d, p = dw(0.01, q=0.1), [pw("p0", 5.0, q=0.3)]  # ITL slack; no prefill worker has TTFT slack
    dec = r.route(_kv("host", 0.3), d, p, 0.0)  # local 0.75 <= 1.0 (the TTFT limit): still local
    assert dec.local and dec.reason == DECODE_SLACK + "+kv-host"
    dec = r.route(_kv("host", 0.8), d, p, 0.0)  # local 1.25 > 1.0: the cost model, remote 0.8
    assert not dec.local and dec.reason == COST_MODEL + "+kv-host"
    dec = r.route(_kv("resident", 0.8), d, p, 0.0)  # room freed by moves still running: no location note
    assert dec.reason == COST_MODEL and dec.estimates["kv_fetch_s"] == 0.8


def test_kv_gone_is_a_full_reprefill_and_says_so():
    r, d, p = adaptive(), dw(0.5, q=0.1), [pw("p0", 5.0, q=0.3)]
    gone = _kv("gone", 0.0, l_hist=0, l_incr=2500)
    plain = PrefillTask("s1", 1, l_hist=0, l_incr=2500, decode_worker="d0")
    a, b = r.route(gone, d, p, 0.0), r.route(plain, d, p, 0.0)
    assert (a.target, a.estimates) == (b.target, b.estimates) and a.reason == b.reason + "+kv-gone"
    for router in (RemoteRouter(), LocalRouter(), ThresholdRouter(1000)):
        assert router.route(gone, d, p, 0.0).reason.endswith("+kv-gone")


def test_margin_router_counts_the_fetch():
    m = MarginRouter(LinearCost(), SLO_, alpha=0.5, beta=0.5)
    d, p = dw(None, q=0.1), [pw("p0", None, q=0.3)]  # no ITL cost: the smaller TTFT wins
    assert m.route(REQ, d, p, 0.0).reason == MARGIN_LOCAL
    dec = m.route(_kv("host", 0.2), d, p, 0.0)
    assert dec.reason == MARGIN_REMOTE + "+kv-host" and dec.estimates["t_local"] == pytest.approx(0.65)


# ------------------------------------- the overlap, live and simulated (services/decode/hostread.py)
def test_kv_on_host_overlap_in_the_prefill_slack_test_and_every_builder():
    """slack="queue": remote max(0.5, fetch 0.6) = 0.6 <= the 1.0 TTFT limit: prefill slack (a remote
    prefill reads the host copy while the fetch runs; before the live decode worker did that, its
    router counted 0.5 + 0.6 = 1.1 here: no slack). The same Eq. (2) through make_router and margin."""
    kw = dict(seed=0, alpha=0.5, beta=0.5, slack="queue")
    d, p = dw(5.0, q=0.1), [pw("p0", None, q=0.3)]
    dec = AdaptiveRouter(LinearCost(), SLO_, **kw).route(_kv("host", 0.6), d, p, 0.0)
    assert dec.reason == PREFILL_SLACK + "+kv-host" and dec.estimates["t_remote:p0"] == pytest.approx(0.6)
    assert make_router("ampd", LinearCost(), SLO_, **kw).route(_kv("host", 0.6), d, p, 0.0) == dec
    m = make_router("margin", LinearCost(), SLO_, alpha=0.5, beta=0.5)
    dec = m.route(_kv("host", 0.2), dw(None, q=0.1), p, 0.0)  # remote max(0.5, 0.2) < local 0.65
    assert dec.reason == MARGIN_REMOTE + "+kv-host" and dec.estimates["t_remote:p0"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="kv_fetch_first"):  # gone with the live path that needed it
        make_router("ampd", LinearCost(), SLO_, kv_fetch_first=True)


def test_remote_after_fetch():
    from ampd.policy.route import remote_after_fetch
    assert remote_after_fetch(0.5, 0.2) == 0.5 and remote_after_fetch(0.5, 0.6) == 0.6
    assert remote_after_fetch(0.5, 0.0) == 0.5


# ---------------- a round that could not claim its host copy (PrefillTask.kv_fetch_first): serial
def test_remote_after_fetch_is_serial_when_the_copy_is_not_readable_remotely():
    from ampd.policy.route import remote_after_fetch
    assert remote_after_fetch(0.5, 0.2, True) == pytest.approx(0.7)
    assert remote_after_fetch(0.5, 0.6, True) == pytest.approx(1.1)
    assert remote_after_fetch(0.5, 0.0, True) == 0.5


def test_kv_fetch_first_counts_the_fetch_before_a_remote_prefill_in_the_cost_model():
    """The setting of test_kv_on_host_local_pays_the_fetch_remote_overlaps_it, the copy unclaimed:
    local 0.35 + 0.1 + 0.2 = 0.65 against remote 0.2 + 0.5 = 0.7 (the overlap said 0.5): local."""
    r = adaptive()
    d, p = dw(0.5, q=0.1), [pw("p0", 5.0, q=0.3)]
    assert not r.route(_kv("host", 0.2), d, p, 0.0).local  # the overlap: remote
    dec = r.route(_kv("host", 0.2, kv_fetch_first=True), d, p, 0.0)
    assert (dec.target, dec.local, dec.reason) == ("d0", True, COST_MODEL + "+kv-host")
    assert dec.estimates["t_local"] == pytest.approx(0.65) and dec.estimates["t_remote:p0"] == pytest.approx(0.7)
    assert dec.estimates["kv_fetch_s"] == 0.2 and dec.estimates["kv_fetch_first"] == 1.0


def test_kv_fetch_first_in_the_prefill_slack_test_and_the_margin_router():
    """slack="queue": remote 0.6 + 0.5 = 1.1 > the 1.0 TTFT limit: no prefill slack (the overlap's
    max(0.5, 0.6) = 0.6 had it). Margin: local 0.65 <= remote 0.7: local (the overlap: remote 0.5)."""
    kw = dict(seed=0, alpha=0.5, beta=0.5, slack="queue")
    d, p = dw(5.0, q=0.1), [pw("p0", None, q=0.3)]
    dec = AdaptiveRouter(LinearCost(), SLO_, **kw).route(_kv("host", 0.6, kv_fetch_first=True), d, p, 0.0)
    assert dec.reason != PREFILL_SLACK + "+kv-host" and dec.estimates["t_remote:p0"] == pytest.approx(1.1)
    m = make_router("margin", LinearCost(), SLO_, alpha=0.5, beta=0.5)
    dec = m.route(_kv("host", 0.2, kv_fetch_first=True), dw(None, q=0.1), p, 0.0)
    assert dec.reason == MARGIN_LOCAL + "+kv-host" and dec.estimates["t_remote:p0"] == pytest.approx(0.7)
