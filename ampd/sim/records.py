"""From a simulation run to the report of DESIGN section 8, through ``ampd.bench.report``.

There is one report code path: every run becomes ``SessionRecord``/``RoundRecord``s handed to
``build_report``, the same code that judges live runs. Small runs keep every token time. Runs
above ``max_full_tokens`` (paper scale: 100k GAIA sessions are ~600M tokens, which do not fit in
memory as tuples) use ``RoundRecord``'s compact form (``n_tokens``, ``last_token``, ``itl_sum``,
``itl_count``; no token times) and pass the step-weighted gap distribution of
``SimResult.itl_samples`` as ``build_report(..., itl_samples=...)`` for the ITL percentiles (see
docs/simulator.md, "Reports"). The SLO rule is therefore the live one in both cases.
"""
from __future__ import annotations

import math

from .gcpause import gc_paused
from .result import SimResult

__all__ = ["to_session_records", "to_compact_session_records", "sim_report", "total_tokens",
           "DEFAULT_MAX_FULL_TOKENS"]

DEFAULT_MAX_FULL_TOKENS = 3_000_000

_UNFINISHED = "unfinished at the end of the simulation"


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
                                 "" if s.completed else (s.error or _UNFINISHED)))
    return out


def to_compact_session_records(res: SimResult) -> list:
    """Every session as a ``SessionRecord`` of compact ``RoundRecord``s (no token times: token
    count, last token time and the round's ITL sum/count)."""
    from ampd.bench.report import RoundRecord, SessionRecord

    out = []
    append = out.append
    for s in res.sessions:
        sid = s.session_id
        rounds = tuple(
            RoundRecord(sid, r.round, r.input_ready, r.first_token, (), r.local, 0, 0,
                        r.n_tokens, r.last_token,
                        r.last_token - r.first_token if r.n_tokens > 1 else 0.0,
                        r.n_tokens - 1 if r.n_tokens > 1 else 0)
            for r in s.rounds
        )
        append(SessionRecord(sid, s.arrival, rounds, s.completed, "" if s.completed else (s.error or _UNFINISHED)))
    return out


def sim_report(res: SimResult, slo, *, max_full_tokens: int = DEFAULT_MAX_FULL_TOKENS,
               extras: bool = True) -> dict:
    """The DESIGN section 8 report of a run (plus a ``"simulation"`` block of run statistics)."""
    with gc_paused():  # ~1M records at paper scale: see gc_paused
        return _sim_report(res, slo, max_full_tokens, extras)


def _sim_report(res: SimResult, slo, max_full_tokens: int, extras: bool) -> dict:
    from ampd.bench.report import build_report

    d = res.duration_s
    duration = d if d > 0 and math.isfinite(d) else 1e-9
    if total_tokens(res) <= max_full_tokens:
        report = build_report(res.policy, to_session_records(res), slo, duration)
        path = "full"
    else:
        report = build_report(res.policy, to_compact_session_records(res), slo, duration,
                              itl_samples=res.itl_samples())
        path = "compact"
    if extras:
        st = dict(res.stats)
        st["report_path"] = path
        report["simulation"] = st
    return report
