"""Simulator fidelity, small: per policy (remote, ampd) one seeded trace replayed live (mock engines,
1 prefill + 1 decode worker) and simulated with the same profile, policy, SLO and window; both
reports come from build_report. The full version (three rates, two policies) is benchmarks/fidelity.py.
Tolerances are the issue's: SLO attainment within 5 points; TTFT and ITL P50/P90 within 10 %.
The simulated side models the live control path's own latencies (``ampd.sim.PathLatency``) with the
values benchmarks/live_overhead.py measured independently (benchmarks/results/live_overhead.json,
``path_latency``: a few ms per round and per tool call, under 1 ms per decode step;
``prefill_busy_extra``: a few ms per remote prefill); ``fid.measured_path`` reads them.
Measured on the 2-core box: attainment equal, every percentile within 2.5 % (two runs); before NIXL's progress thread stopped busy-polling a
core per agent the live side was CPU-starved and drifted by 15-40 %.
Why it holds reliably (docs/fidelity.md):
- TP 1 of qwen3-32b@h20: prefill ~0.72 s per 1k tokens, a decode step ~22 ms. What the simulator
  models only as medians and means (the path latencies, the prefill worker's per-task extra) or not
  at all (the mock's millisecond timer slack on decode steps) varies by a few % of these costs.
- 11-13 sessions, so one session flipping would move attainment by 8-9 points: each trace seed and
  the TTFT SLO are chosen so that, in the simulation, every session's worst TTFT and its mean ITL are
  at least 15 % away from their thresholds (checked below; remote 24 %, ampd 20 % on these traces
  with the measured path latencies), so a few-% timing difference cannot flip a verdict.
- Percentiles of ~45 TTFTs are sensitive to the order in which rounds queue at the one prefill
  worker; the traces' simulated TTFT P50/P90 move by at most 8 % / 2 % (remote) and 5 % / 5 % (ampd)
  when arrivals and tool times are jittered by 0-60 ms (eight draws).
- Placement: remote sends every prefill to the prefill worker. With ampd, a round whose predicted
  TTFT is near the router's limit goes local or remote depending on a few ms (docs/fidelity.md);
  its trace (seed 51) is one where the simulated placements (42 prefill-slack, 1 decode-slack) are the
  same in every jittered draw and without the path latencies, so live and simulated local
  fractions must be equal.
"""
from __future__ import annotations


import pytest

from ampd.bench.report import SLO, judge_session
from ampd.launcher import Deployment
from ampd.sim import to_session_records
from benchmarks import fidelity as fid

ATTAINMENT_TOL_POINTS = 5.0
LATENCY_TOL_REL = 0.10  # ITL P50
TTFT_TOL_REL = 0.10     # TTFT P50/P90
ITL_P90_TOL_REL = 0.10  # ITL P90
TTFT_SLO_S = 2.5        # with these trace seeds: no simulated session within 15 % of a threshold
TRACES = {"remote": fid.Case("medium", rate=0.4, duration=30.0, seed=36),
          "ampd": fid.Case("medium", rate=0.4, duration=30.0, seed=51)}
MIN_SIM_MARGIN = 0.15


SLO_ = SLO(TTFT_SLO_S, fid.ITL_SLO_S)


def _sim_margin(res) -> float:
    """The smallest relative distance of any session's worst TTFT / mean ITL to its threshold."""
    margin = float("inf")
    for r in to_session_records(res):
        worst = max(x.first_token - x.input_ready for x in r.rounds)
        v = judge_session(r, SLO_)
        margin = min(margin, abs(worst / SLO_.ttft_s - 1), abs((v.mean_itl or 0.0) / SLO_.itl_s - 1))
    return margin


@pytest.mark.fidelity
@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", sorted(TRACES))
def test_simulator_matches_live_bench_on_one_trace(policy, redis_url, tmp_path):
    sessions = fid.trace(TRACES[policy])
    assert len(sessions) >= 10
    path = fid.measured_path()  # benchmarks/results/live_overhead.json, measured apart from this test
    assert not path.zero
    sim, res = fid.run_sim(sessions, policy, slo_=SLO_, path=path)
    assert sim["completed"] == len(sessions)
    # The premise of a 5-point bound on 11-13 sessions (see the module docstring). If this fails, the
    # simulator's result for this trace changed: pick a trace/SLO with margins again.
    assert _sim_margin(res) >= MIN_SIM_MARGIN

    opts = fid.options(policy, redis_url, str(tmp_path), namespace="fidelity-test", slo_=SLO_)
    with Deployment(opts) as dep:
        fid.warm_up(dep.coordinator)
        live = fid.run_live(dep.coordinator, sessions, policy, slo_=SLO_)
    assert live["completed"] == len(sessions), live["errors"]
    cmp = fid.compare(live, sim)
    assert cmp["rounds"]["live"] == cmp["rounds"]["sim"] == sum(len(s.rounds) for s in sessions)
    # Enough samples for a P90: 42-43 rounds (TTFT), ~2,000 token gaps (ITL).
    assert cmp["ttft_samples"] >= 40 and cmp["itl_samples"] >= 1000

    report = {k: cmp[k] for k in ("slo_attainment", "local_fraction", "ttft_p50", "ttft_p90",
                                  "itl_p50", "itl_p90")}
    print(f"fidelity live vs sim: {report}")
    assert abs(cmp["slo_attainment"]["diff_points"]) <= ATTAINMENT_TOL_POINTS, report
    for q in ("p50", "p90"):
        assert abs(cmp[f"ttft_{q}"]["rel_diff"]) <= TTFT_TOL_REL, report
    assert abs(cmp["itl_p50"]["rel_diff"]) <= LATENCY_TOL_REL, report
    itl90 = cmp["itl_p90"]
    assert itl90["sim_s"] * (1 - LATENCY_TOL_REL) <= itl90["live_s"] <= itl90["sim_s"] * (1 + ITL_P90_TOL_REL), report
    # The same placements on both sides (remote: every prefill on the prefill worker).
    assert cmp["local_fraction"]["sim"] == cmp["local_fraction"]["live"], report
    if policy == "remote":
        assert cmp["local_fraction"]["live"] == 0.0
