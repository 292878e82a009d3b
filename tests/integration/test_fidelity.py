"""Simulator fidelity, small: one seeded trace replayed live (mock engines, 1 prefill + 1 decode
worker, policy ampd) and simulated with the same profile, policy, SLO and window; both reports come
from build_report. The full version (three rates, two policies) is benchmarks/fidelity.py.

Tolerances (the issue's): SLO attainment within 5 points; TTFT and ITL P50 and P90 within 10 %
(relative to live). Why they hold on a loaded 2-core box (docs/fidelity.md):
- TP 1 of qwen3-32b@h20: prefill ~0.72 s per 1k tokens, a decode step ~22 ms. The live path adds
  ~15 ms to a round's TTFT and ~0.8 ms to a decode step (measured), a few % of these costs.
- 11 sessions, so one session flipping would move attainment by 9 points: the trace seed and the
  TTFT SLO are chosen so that, in the simulation, every session's worst TTFT and its mean ITL are
  at least ~15 % away from their thresholds (checked below), i.e. a few-% timing difference cannot
  flip a verdict.
"""
from __future__ import annotations

import pytest

from ampd.bench.report import SLO, judge_session
from ampd.launcher import Deployment
from ampd.perf import load_profile
from ampd.sim import simulate, to_session_records
from benchmarks import fidelity as fid

ATTAINMENT_TOL_POINTS = 5.0
LATENCY_TOL_REL = 0.10
TTFT_SLO_S = 2.0        # with trace seed 14: no simulated session within 15 % of a threshold
TRACE = fid.Case("medium", rate=0.4, duration=30.0, seed=14)
POLICY = "ampd"
MIN_SIM_MARGIN = 0.15


@pytest.fixture(autouse=True)
def _slo(monkeypatch):
    monkeypatch.setattr(fid, "TTFT_SLO_S", TTFT_SLO_S)


def _sim_margin(sessions) -> float:
    """The smallest relative distance of any session's worst TTFT / mean ITL to its threshold."""
    res = simulate(sessions, load_profile(fid.PROFILE), policy=POLICY, prefill=fid.PREFILL,
                   decode=fid.DECODE, ttft_slo_s=TTFT_SLO_S, itl_slo_s=fid.ITL_SLO_S, seed=fid.SEED,
                   window_s=fid.WINDOW_S)
    margin = float("inf")
    for r in to_session_records(res):
        worst = max(x.first_token - x.input_ready for x in r.rounds)
        v = judge_session(r, SLO(TTFT_SLO_S, fid.ITL_SLO_S))
        margin = min(margin, abs(worst / TTFT_SLO_S - 1), abs((v.mean_itl or 0.0) / fid.ITL_SLO_S - 1))
    return margin


@pytest.mark.timeout(240)
def test_simulator_matches_live_bench_on_one_trace(redis_url, tmp_path):
    sessions = fid.trace(TRACE)
    assert len(sessions) >= 10
    # The premise of a 5-point bound on 11 sessions (see the module docstring).
    assert _sim_margin(sessions) >= MIN_SIM_MARGIN

    with Deployment(fid.options(POLICY, redis_url, str(tmp_path), namespace="fidelity-test")) as dep:
        fid.warm_up(dep.coordinator)
        live = fid.run_live(dep.coordinator, sessions, POLICY)
    assert live["completed"] == len(sessions), live["errors"]
    sim = fid.run_sim(sessions, POLICY)
    assert sim["completed"] == len(sessions)
    cmp = fid.compare(live, sim)
    assert cmp["rounds"]["live"] == cmp["rounds"]["sim"] == sum(len(s.rounds) for s in sessions)
    # Enough samples for a P90: ~45 rounds (TTFT), ~2,000 token gaps (ITL).
    assert cmp["ttft_samples"] >= 40 and cmp["itl_samples"] >= 1000

    report = {k: cmp[k] for k in ("slo_attainment", "local_fraction", "ttft_p50", "ttft_p90",
                                  "itl_p50", "itl_p90")}
    bad = fid.within(cmp, ATTAINMENT_TOL_POINTS, LATENCY_TOL_REL, ("p50", "p90"))
    assert not bad, f"out of tolerance: {bad}\n{report}"
    # Both sides make the same kind of routing decisions (ampd keeps some prefills local here).
    assert cmp["local_fraction"]["sim"] is not None and cmp["local_fraction"]["live"] is not None
