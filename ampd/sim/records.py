"""From a simulation run to the report of DESIGN section 8, through ``ampd.bench.report``.

Small runs are converted to ``SessionRecord``/``RoundRecord`` with every token time and handed to
``build_report``: the same code that judges live runs. ``RoundRecord`` only takes whole
``token_times`` tuples, which for paper-scale runs (100k GAIA sessions: ~600M tokens) do not fit in
memory; above ``max_full_tokens`` this module computes the same report from the compact per-round
form (first token, last token, token count) and the step-weighted gap distribution of
``SimResult.itl_samples`` (see docs/simulator.md, "Reports"). The compact path reuses
``latency_summary`` and the SLO rule of ``judge_session`` (span / gaps per session); only the ITL
percentiles are computed here, as weighted percentiles.
"""
from __future__ import annotations

import math

import numpy as np

from .engine import SimResult

__all__ = ["to_session_records", "sim_report", "total_tokens", "DEFAULT_MAX_FULL_TOKENS"]

DEFAULT_MAX_FULL_TOKENS = 3_000_000


def total_tokens(res: SimResult) -> int:
    return sum(r.n_tokens for s in res.sessions for r in s.rounds)


def to_session_records(res: SimResult) -> list:
    """Every session as an ``ampd.bench.report.SessionRecord`` with full token times."""
    from ampd.bench.report import RoundRecord, SessionRecord

    out = []
    for s in res.sessions:
        rounds = tuple(
            RoundRecord(s.session_id, r.round, r.input_ready, r.first_token, res.token_times(r), r.local)
            for r in s.rounds
        )
        out.append(SessionRecord(s.session_id, s.arrival, rounds, s.completed,
                                 "" if s.completed else "unfinished at the end of the simulation"))
    return out


def _duration(res: SimResult) -> float:
    d = res.duration_s
    return d if d > 0 and math.isfinite(d) else 1e-9


def _weighted_summary(values: np.ndarray, weights: np.ndarray) -> dict:
    """{"mean", "p50", "p90", "p99"} of a weighted sample (the sample with value v repeated w
    times), with numpy's default linear interpolation between order statistics."""
    n = float(weights.sum()) if weights.size else 0.0
    if n <= 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    order = np.argsort(values, kind="stable")
    v = values[order]
    cum = np.cumsum(weights[order])  # cum[i]: count of samples <= v[i]
    out = {"mean": float(np.dot(values, weights) / n)}
    for q in (50, 90, 99):
        h = (n - 1) * q / 100.0  # 0-based rank, as np.percentile "linear"
        lo = math.floor(h)
        hi = min(lo + 1, n - 1)
        last = len(v) - 1
        a = v[min(int(np.searchsorted(cum, lo + 1 - 1e-9)), last)]
        b = v[min(int(np.searchsorted(cum, hi + 1 - 1e-9)), last)]
        out[f"p{q}"] = float(a + (b - a) * (h - lo))
    return out


def _compact_report(res: SimResult, slo) -> dict:
    from ampd.bench.report import EPS_S, build_report, latency_summary

    duration = _duration(res)
    # the skeleton of the report (keys, order, extras) from build_report itself, then the numbers
    report = build_report(res.policy, [], slo, duration)
    n = len(res.sessions)
    completed = attained = ttft_ok_n = itl_ok_n = 0
    ttft_init: list[float] = []
    ttft_incr: list[float] = []
    e2e: list[float] = []
    local = remote = rounds_total = tokens = 0
    for s in res.sessions:
        ok_t = bool(s.rounds)
        span = 0.0
        gaps = 0
        for r in s.rounds:
            rounds_total += 1
            t = r.first_token - r.input_ready
            (ttft_init if r.round == 0 else ttft_incr).append(t)
            if t > slo.ttft_s + EPS_S:
                ok_t = False
            if r.local:
                local += 1
            else:
                remote += 1
            tokens += r.n_tokens
            if r.n_tokens >= 2:
                span += r.last_token - r.first_token
                gaps += r.n_tokens - 1
        ok_i = gaps == 0 or span / gaps <= slo.itl_s + EPS_S
        ttft_ok_n += ok_t
        itl_ok_n += ok_i
        if s.completed:
            completed += 1
            attained += ok_t and ok_i
            if s.rounds:
                e2e.append(s.rounds[-1].last_token - s.arrival)
    vals, wts = res.itl_samples()
    placed = local + remote
    report.update({
        "sessions": n,
        "completed": completed,
        "failed": n - completed,
        "slo_attainment": attained / n if n else 0.0,
        "goodput_rps": attained / duration,
        "local_fraction": local / placed if placed else None,
        "ttft_s": latency_summary(ttft_init + ttft_incr),
        "ttft_initial_s": latency_summary(ttft_init),
        "ttft_incremental_s": latency_summary(ttft_incr),
        "itl_s": _weighted_summary(vals, wts),
        "e2e_s": latency_summary(e2e),
        "attained": attained,
        "ttft_attainment": ttft_ok_n / n if n else 0.0,
        "itl_attainment": itl_ok_n / n if n else 0.0,
        "rounds": rounds_total,
        "rounds_with_first_token": rounds_total,
        "local_prefills": local,
        "remote_prefills": remote,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "errors": ({"unfinished at the end of the simulation": n - completed} if n - completed else {}),
    })
    return report


def sim_report(res: SimResult, slo, *, max_full_tokens: int = DEFAULT_MAX_FULL_TOKENS,
               extras: bool = True) -> dict:
    """The DESIGN section 8 report of a run (plus a ``"simulation"`` block of run statistics)."""
    from ampd.bench.report import build_report

    if total_tokens(res) <= max_full_tokens:
        report = build_report(res.policy, to_session_records(res), slo, _duration(res))
        path = "full"
    else:
        report = _compact_report(res, slo)
        path = "compact"
    if extras:
        st = dict(res.stats)
        st["report_path"] = path
        report["simulation"] = st
    return report
