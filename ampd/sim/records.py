"""From a simulation run to the report of docs/report.md, through ``ampd.bench.report``.

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
           "DEFAULT_MAX_FULL_TOKENS", "compact_report"]

DEFAULT_MAX_FULL_TOKENS = 3_000_000

_UNFINISHED = "unfinished at the end of the simulation"


def total_tokens(res: SimResult, above: int | None = None) -> int:
    """The run's output tokens; with ``above``, counted only until they pass it (``sim_report``
    asks whether the run fits the full report: a paper-scale run passes 3M in its first 1 % of
    sessions, where the whole count is a pass over its 1.1M rounds)."""
    tokens = 0
    for s in res.sessions:
        for r in s.rounds:
            tokens += r.n_tokens
        if above is not None and tokens > above:
            break
    return tokens


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

    out: list[SessionRecord] = []
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
    """The docs/report.md report of a run (plus a ``"simulation"`` block of run statistics)."""
    with gc_paused():  # ~1M records at paper scale: see gc_paused
        return _sim_report(res, slo, max_full_tokens, extras)


def _sim_report(res: SimResult, slo, max_full_tokens: int, extras: bool) -> dict:
    from ampd.bench.report import build_report

    d = res.duration_s
    duration = d if d > 0 and math.isfinite(d) else 1e-9
    if total_tokens(res, max_full_tokens) <= max_full_tokens:
        report = build_report(res.policy, to_session_records(res), slo, duration)
        path = "full"
    else:
        report = compact_report(res, slo, duration)
        path = "compact"
    if extras:
        st = dict(res.stats)
        st["report_path"] = path
        report["simulation"] = st
    return report


def compact_report(res: SimResult, slo, duration: float) -> dict:
    """``build_report(res.policy, to_compact_session_records(res), slo, duration,
    itl_samples=res.itl_samples())`` without building a record per round: one pass over the
    rounds into flat lists, then numpy. The same numbers (same samples in the same order, the same
    SLO rule, ``judge_session``'s, written out for compact rounds); a test in tests/unit/test_sim.py
    compares the two. Measured: the 100k-session GAIA report went from 14.5 CPU s (on a loaded box)
    to 8.3 (benchmarks/results/sim_speed.json), then, compiled, from 2.2-4.4 to 1.1-1.4 (the ITL
    samples read in pieces, the rounds' first steps gathered in this pass: docs/simulator.md)."""
    from collections import Counter

    import numpy as np  # imported here: a planner run does not pay for it

    from ampd.bench.report import EPS_S, assemble_report, weighted_summary_of

    from .steplog import FirstSteps, ItlPieces

    ttft_lim = slo.ttft_s + EPS_S
    itl_lim = slo.itl_s + EPS_S
    ttft_all: list[float] = []
    is_init: list[bool] = []
    e2e: list[float] = []
    errors: Counter[str] = Counter()
    n = len(res.sessions)
    completed = attained = ttft_ok_n = itl_ok_n = 0
    local = remote = rounds_total = rounds_done = tokens = 0
    add_t = ttft_all.append
    add_i = is_init.append
    firsts = FirstSteps()  # for the ITL samples, gathered in this pass over the rounds, not another
    for s in res.sessions:
        rounds = s.rounds
        ttft_ok = bool(rounds)
        span = 0.0
        gaps = 0
        # SimRound's fields unpacked (one C loop) rather than read by name, per round
        for rnd, ready, ft, last, nt, loc, worker, step_lo, _ in rounds:
            if loc is True:
                local += 1
            elif loc is False:
                remote += 1
            if ft is None:
                ttft_ok = False
            else:
                t = ft - ready
                if t > ttft_lim:
                    ttft_ok = False
                add_t(t)
                add_i(rnd == 0)
            if nt:
                tokens += nt
                if nt > 1:
                    span += last - ft
                    gaps += nt - 1
                    firsts.add(ft, worker, step_lo)
        rounds_total += len(rounds)
        itl_ok = not gaps or span / gaps <= itl_lim
        ttft_ok_n += ttft_ok
        itl_ok_n += itl_ok
        if s.completed:
            completed += 1
            attained += ttft_ok and itl_ok
            if rounds:
                final = rounds[-1]
                end = final.last_token if final.last_token is not None else final.first_token
                if end is not None:
                    e2e.append(end - s.arrival)
        else:
            errors[s.error or _UNFINISHED] += 1
    rounds_done = len(ttft_all)
    ttft = np.asarray(ttft_all, dtype=float)
    init = np.asarray(is_init, dtype=bool)
    return assemble_report(res.policy, slo, duration, n=n, completed=completed, attained=attained,
                           ttft_ok=ttft_ok_n, itl_ok=itl_ok_n, local=local, remote=remote, ttft_all=ttft,
                           ttft_init=ttft[init], ttft_incr=ttft[~init],
                           itl_summary=weighted_summary_of(ItlPieces(res.step_logs, firsts)), e2e=e2e,
                           rounds_total=rounds_total, rounds_done=rounds_done, tokens=tokens, errors=errors)
