"""SLO accounting (ampd/bench/report.py) on hand-computed records."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ampd.bench.report import (REPORT_KEYS, SLO, RoundRecord, SessionRecord, build_report,
                               format_report, judge_session, latency_summary)

SLOS = SLO(ttft_s=0.5, itl_s=0.25)


def rnd(sid, k, ready, first, gaps=(), local=None):
    """A round whose tokens come at first, first+g1, first+g1+g2, ..."""
    times = [first] if first is not None else []
    for g in gaps:
        times.append(times[-1] + g)
    return RoundRecord(sid, k, ready, first, tuple(times), local)


def sess(sid, arrival, rounds, completed=True, error=""):
    return SessionRecord(sid, arrival, tuple(rounds), completed, error)


def test_ttft_miss_by_one_ms_fails():
    ok = sess("a", 0.0, [rnd("a", 0, 0.0, 0.5, (0.25,)), rnd("a", 1, 2.0, 2.5, (0.25,))])
    late = sess("b", 0.0, [rnd("b", 0, 0.0, 0.5, (0.25,)), rnd("b", 1, 2.0, 2.501, (0.25,))])
    assert judge_session(ok, SLOS).attained
    v = judge_session(late, SLOS)
    assert not v.attained and not v.ttft_ok and v.itl_ok


def test_mean_itl_exactly_at_threshold_passes():
    # gaps 0.125, 0.375 in round 0 and 0.25 in round 1: mean 0.25 although one gap is over
    s = sess("a", 0.0, [rnd("a", 0, 0.0, 0.1, (0.125, 0.375)), rnd("a", 1, 1.0, 1.1, (0.25,))])
    v = judge_session(s, SLOS)
    assert v.mean_itl == pytest.approx(0.25) and v.itl_ok and v.attained
    # gaps across rounds are not gaps: the time between rounds does not count
    over = sess("b", 0.0, [rnd("b", 0, 0.0, 0.1, (0.125, 0.376))])
    assert not judge_session(over, SLOS).itl_ok


def test_float_noise_at_threshold_passes():
    s = sess("a", 0.0, [RoundRecord("a", 0, 0.1, 0.6, (0.6, 0.7, 0.8, 0.9), None)])
    assert judge_session(s, SLO(0.5, 0.1)).attained      # 0.6 - 0.1 and gaps of ~0.1 in floats


def test_failed_and_missing_first_token_do_not_attain():
    failed = sess("a", 0.0, [rnd("a", 0, 0.0, 0.1, (0.1,))], completed=False, error="timeout")
    assert judge_session(failed, SLOS).ttft_ok and not judge_session(failed, SLOS).attained
    no_first = sess("b", 0.0, [rnd("b", 0, 0.0, 0.1), rnd("b", 1, 1.0, None)])
    assert not judge_session(no_first, SLOS).attained
    assert not judge_session(sess("c", 0.0, []), SLOS).attained


def test_single_token_rounds_have_no_itl():
    s = sess("a", 0.0, [rnd("a", 0, 0.0, 0.2), rnd("a", 1, 1.0, 1.3)])
    v = judge_session(s, SLOS)
    assert v.mean_itl is None and v.itl_ok and v.attained


def _sample():
    return [
        # attains: ttfts 0.25 (initial), 0.5 (incr); gaps 0.125 x2 | 0.25; local remote
        sess("a", 0.0, [rnd("a", 0, 0.0, 0.25, (0.125, 0.125), local=False),
                        rnd("a", 1, 1.0, 1.5, (0.25,), local=True)]),
        # TTFT miss: 0.75 initial; gap 0.125
        sess("b", 1.0, [rnd("b", 0, 1.0, 1.75, (0.125,), local=False)]),
        # failed after round 0 (ttft 0.125, no gaps); placement unknown
        sess("c", 2.0, [rnd("c", 0, 2.0, 2.125, (), local=None),
                        rnd("c", 1, 3.0, None, (), local=True)], completed=False, error="worker died"),
        # ITL miss: gaps 0.5, 0.25 -> mean 0.375; ttft 0.0625
        sess("d", 3.0, [rnd("d", 0, 3.0, 3.0625, (0.5, 0.25), local=False)]),
    ]


def test_build_report_hand_computed():
    r = build_report("ampd", _sample(), SLOS, duration_s=4.0)
    assert list(r)[:len(REPORT_KEYS)] == list(REPORT_KEYS)
    assert r["policy"] == "ampd" and r["sessions"] == 4
    assert r["completed"] == 3 and r["failed"] == 1
    assert r["slo_attainment"] == 0.25 and r["attained"] == 1
    assert r["goodput_rps"] == 0.25
    assert r["ttft_attainment"] == 0.5        # a, d (c never got round 1's first token)
    assert r["itl_attainment"] == 0.75        # a, b, c
    assert r["local_fraction"] == pytest.approx(2 / 5)
    assert (r["local_prefills"], r["remote_prefills"]) == (2, 3)

    ttft = [0.25, 0.5, 0.75, 0.125, 0.0625]
    assert r["ttft_s"]["mean"] == pytest.approx(np.mean(ttft))
    assert r["ttft_s"]["p50"] == 0.25
    assert r["ttft_s"]["p90"] == pytest.approx(0.5 + 0.6 * 0.25)       # linear interpolation
    assert r["ttft_initial_s"] == latency_summary([0.25, 0.75, 0.125, 0.0625])
    assert r["ttft_incremental_s"] == {"mean": 0.5, "p50": 0.5, "p90": 0.5, "p99": 0.5}
    gaps = [0.125, 0.125, 0.25, 0.125, 0.5, 0.25]
    assert r["itl_s"]["mean"] == pytest.approx(np.mean(gaps))
    assert r["itl_s"]["p50"] == pytest.approx(0.1875)
    assert r["itl_s"]["p99"] == pytest.approx(np.percentile(gaps, 99))
    # e2e over completed sessions: a 1.75, b 1.875, d 0.8125
    assert r["e2e_s"]["mean"] == pytest.approx((1.75 + 0.875 + 0.8125) / 3)
    assert r["e2e_s"]["p50"] == pytest.approx(0.875)
    assert r["errors"] == {"worker died": 1}
    assert r["slo"] == {"ttft_s": 0.5, "itl_s": 0.25}
    json.dumps(r, allow_nan=False)            # plain JSON types only


def test_empty_report_has_nulls():
    r = build_report("dynamo", [], SLOS, 10.0)
    assert r["sessions"] == 0 and r["slo_attainment"] == 0.0 and r["goodput_rps"] == 0.0
    assert r["local_fraction"] is None
    for key in ("ttft_s", "ttft_initial_s", "ttft_incremental_s", "itl_s", "e2e_s"):
        assert r[key] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert "policy dynamo" in format_report(r)


def test_local_fraction_null_when_placement_unknown():
    s = [sess("a", 0.0, [rnd("a", 0, 0.0, 0.1, (0.1,), local=None)])]
    assert build_report("vllm", s, SLOS, 1.0)["local_fraction"] is None


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_bad_inputs(bad):
    with pytest.raises(ValueError):
        SLO(bad, 0.1)
    with pytest.raises(ValueError):
        SLO(0.1, bad)
    with pytest.raises(ValueError):
        build_report("x", [], SLOS, bad)


def test_format_report():
    text = format_report(build_report("ampd", _sample(), SLOS, 4.0))
    assert "SLO attainment 25.0 %" in text
    assert "local prefills  40.0 %  (2 of 5)" in text
    for label in ("ttft", "initial", "incremental", "itl", "e2e"):
        assert label in text
    assert "250.0 ms" in text and "worker died" in text


# ------------------------------------------------------------------ compact rounds, weighted ITL
def _compact(r: RoundRecord, with_aggregates=True) -> RoundRecord:
    tt = r.token_times
    n = len(tt)
    kw = dict(n_tokens=n, last_token=tt[-1] if tt else None)
    if with_aggregates and n >= 2:
        kw.update(itl_sum=tt[-1] - tt[0], itl_count=n - 1)
    return RoundRecord(r.session_id, r.round, r.input_ready, r.first_token, (), r.local, **kw)


def _sessions():
    return [
        sess("a", 0.0, [rnd("a", 0, 0.0, 0.25, (0.125, 0.375), True), rnd("a", 1, 1.0, 1.5, (0.25,), False)]),
        sess("b", 0.1, [rnd("b", 0, 0.1, 0.4, (0.1, 0.2, 0.3), False)]),
        sess("c", 0.2, [rnd("c", 0, 0.2, 0.9)], completed=False, error="worker died"),
        sess("d", 0.3, [rnd("d", 0, 0.3, 0.5, (0.5,), None)]),
    ]


@pytest.mark.parametrize("with_aggregates", [True, False])
def test_compact_records_give_the_same_report(with_aggregates):
    full = _sessions()
    compact = [SessionRecord(s.session_id, s.arrival, tuple(_compact(r, with_aggregates) for r in s.rounds),
                             s.completed, s.error) for s in full]
    gaps = np.concatenate([np.diff(r.token_times) for s in full for r in s.rounds if len(r.token_times) > 1])
    a = build_report("p", full, SLOS, 4.0)
    b = build_report("p", compact, SLOS, 4.0, itl_samples=(gaps, np.ones(gaps.size)))
    assert list(a) == list(b)
    for k, v in a.items():
        if isinstance(v, dict) and "p50" in v:
            for q in v:
                assert b[k][q] == pytest.approx(v[q], rel=1e-12, abs=1e-12), (k, q)
        else:
            assert b[k] == v, k
    for fs, cs in zip(full, compact):
        vf, vc = judge_session(fs, SLOS), judge_session(cs, SLOS)
        assert (vf.ttft_ok, vf.itl_ok, vf.attained) == (vc.ttft_ok, vc.itl_ok, vc.attained)
        assert (vf.mean_itl is None) == (vc.mean_itl is None)
        if vf.mean_itl is not None:
            assert vc.mean_itl == pytest.approx(vf.mean_itl)
    # without samples: the mean ITL is exact (each compact round's mean gap, weighted by its gaps)
    c = build_report("p", compact, SLOS, 4.0)
    assert c["itl_s"]["mean"] == pytest.approx(a["itl_s"]["mean"])
    assert c["output_tokens"] == a["output_tokens"] and c["e2e_s"] == a["e2e_s"]


def test_weighted_itl_samples_match_repeated_samples():
    from ampd.bench.report import weighted_latency_summary

    rng = np.random.default_rng(0)
    v = rng.random(50)
    w = rng.integers(0, 5, 50)
    w[0] = 3
    rep = np.repeat(v, w)
    got = weighted_latency_summary(v, w)
    want = latency_summary(rep)
    for q in want:
        assert got[q] == pytest.approx(want[q], rel=1e-12), q
    assert weighted_latency_summary([], [])["p50"] is None
    assert weighted_latency_summary([1.0], [0.0])["mean"] is None
    with pytest.raises(ValueError):
        weighted_latency_summary([1.0, 2.0], [1.0])
    for bad in (-1.0, np.inf, np.nan):
        with pytest.raises(ValueError):
            weighted_latency_summary([1.0, 2.0], [1.0, bad])
    s = [sess("a", 0.0, [rnd("a", 0, 0.0, 0.1, (0.2,))])]
    r = build_report("p", s, SLOS, 1.0, itl_samples=(v, w))
    assert r["itl_s"] == got
    assert r["slo_attainment"] == 1.0  # verdicts use the session's own gaps, not the samples


def _large_sample(kind, rng, n):
    if kind == "latencies":
        return np.round(rng.lognormal(-4, 0.5, n), 5)
    v = np.round(rng.normal(0, 1, n), 3)  # signed, with ties, 0.0 and -0.0
    v[::7] = -0.0
    if kind == "extremes":  # buckets over the whole float range
        v[:4] = [1e-300, -1e300, 1e300, np.inf]
    return v


@pytest.mark.parametrize("kind", ["latencies", "signed", "extremes"])
def test_weighted_summary_selects_the_percentiles_of_a_large_sample(kind):
    # above _SORT_WHOLE the percentiles are selected bucket by bucket: the same numbers as the
    # repeated sample's np.percentile (integer weights, ties and zero weights included)
    from ampd.bench import report

    rng = np.random.default_rng(5)
    n = report._SORT_WHOLE + 30_000
    v = _large_sample(kind, rng, n)
    w = rng.integers(0, 4, n).astype(float)
    got = report.weighted_latency_summary(v, w)
    want = report.latency_summary(np.repeat(v, w.astype(int)))
    for k in ("p50", "p90", "p99"):
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=0)


def test_weighted_summary_of_pieces_is_that_of_the_sample_joined():
    # however the sample is cut, the numbers are the same bits (sums run over fixed blocks)
    from ampd.bench import report

    rng = np.random.default_rng(7)
    n = 3 * report.SAMPLE_BLOCK + 12_345
    v, w = rng.lognormal(-4, 0.5, n), rng.random(n) * 4
    cuts = np.sort(rng.choice(n, 40, replace=False))
    pieces = list(zip(np.split(v, cuts), np.split(w, cuts)))
    got = report.weighted_summary_of(lambda: iter(pieces))
    assert got == report.weighted_latency_summary(v, w)
    assert got["mean"] == pytest.approx(np.dot(v, w) / w.sum(), rel=1e-12)
