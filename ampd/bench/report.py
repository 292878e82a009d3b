"""SLO accounting shared by the live `ampd bench` and `ampd simulate` (pure; DESIGN.md sections 5, 8).

Callers record what happened to every session as ``SessionRecord``s (times in seconds on one
clock) and call ``build_report``; both commands therefore judge SLOs by the same rule.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["SLO", "RoundRecord", "SessionRecord", "SessionVerdict", "judge_session",
           "build_report", "format_report", "latency_summary", "REPORT_KEYS", "EPS_S"]

# Comparisons with a threshold allow this much float noise (far below any meaningful latency).
EPS_S = 1e-9

REPORT_KEYS = ("policy", "sessions", "completed", "failed", "slo_attainment", "goodput_rps",
               "local_fraction", "ttft_s", "ttft_initial_s", "ttft_incremental_s", "itl_s", "e2e_s")


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-round TTFT threshold and per-session mean-ITL threshold, in seconds."""

    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SLO {name} must be a finite number > 0 seconds, got {v!r}")


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """What happened in one round. ``input_ready``: arrival (round 0) or tool result time;
    ``first_token``: None if it never came; ``token_times``: every token of the round including
    the first; ``local``: prefill ran on the decode worker (True), a prefill worker (False) or
    unknown (None); ``l_hist``/``l_incr``: the prefill task's sizes (informational)."""

    session_id: str
    round: int
    input_ready: float
    first_token: float | None
    token_times: tuple[float, ...]
    local: bool | None
    l_hist: int = 0
    l_incr: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.input_ready

    @property
    def end(self) -> float | None:
        """Time of the round's last token (its first token if no token times were kept)."""
        if self.token_times:
            return self.token_times[-1]
        return self.first_token


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: str
    arrival: float
    rounds: tuple[RoundRecord, ...]
    completed: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class SessionVerdict:
    """How one session fared against the SLO."""

    ttft_ok: bool          # every round has a first token within ttft_s
    itl_ok: bool           # mean ITL over all its token gaps <= itl_s (vacuous with no gaps)
    mean_itl: float | None
    attained: bool         # completed and ttft_ok and itl_ok


def judge_session(s: SessionRecord, slo: SLO) -> SessionVerdict:
    """DESIGN.md section 5: a session attains the SLO when it completed, every round's TTFT
    (first_token - input_ready) <= ttft_s and its mean ITL (all gaps between consecutive tokens
    within rounds, across its rounds) <= itl_s."""
    ttft_ok = bool(s.rounds) and all(
        r.first_token is not None and r.first_token - r.input_ready <= slo.ttft_s + EPS_S
        for r in s.rounds)
    span = 0.0
    gaps = 0
    for r in s.rounds:
        if len(r.token_times) >= 2:
            span += r.token_times[-1] - r.token_times[0]   # sum of the round's gaps
            gaps += len(r.token_times) - 1
    mean_itl = span / gaps if gaps else None
    itl_ok = mean_itl is None or mean_itl <= slo.itl_s + EPS_S
    return SessionVerdict(ttft_ok, itl_ok, mean_itl, bool(s.completed) and ttft_ok and itl_ok)


def latency_summary(samples) -> dict:
    """{"mean", "p50", "p90", "p99"} (numpy linear interpolation); all None without samples."""
    a = np.asarray(samples, dtype=float)
    if a.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def build_report(policy: str, sessions: Sequence[SessionRecord], slo: SLO, duration_s: float) -> dict:
    """The report of DESIGN.md section 8 (its keys first, then extras).

    Latency samples come from every round that has them, including rounds of sessions that later
    failed; ``e2e_s`` (last token of the last round minus arrival) only from completed sessions.
    ``slo_attainment`` and ``goodput_rps`` count attaining sessions over all sessions and over
    ``duration_s`` respectively."""
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    n = len(sessions)
    completed = sum(1 for s in sessions if s.completed)
    ttft_all: list[float] = []
    ttft_init: list[float] = []
    ttft_incr: list[float] = []
    itl_parts: list[np.ndarray] = []
    e2e: list[float] = []
    attained = ttft_ok = itl_ok = 0
    local = remote = 0
    rounds_total = rounds_done = 0
    tokens = 0
    errors: Counter[str] = Counter()
    for s in sessions:
        v = judge_session(s, slo)
        attained += v.attained
        ttft_ok += v.ttft_ok
        itl_ok += v.itl_ok
        if not s.completed:
            errors[s.error or "incomplete"] += 1
        for r in s.rounds:
            rounds_total += 1
            if r.local is True:
                local += 1
            elif r.local is False:
                remote += 1
            if r.first_token is not None:
                t = r.first_token - r.input_ready
                ttft_all.append(t)
                (ttft_init if r.round == 0 else ttft_incr).append(t)
                rounds_done += 1
            tokens += len(r.token_times)
            if len(r.token_times) >= 2:
                itl_parts.append(np.diff(np.asarray(r.token_times, dtype=float)))
        if s.completed and s.rounds:
            end = s.rounds[-1].end
            if end is not None:
                e2e.append(end - s.arrival)
    itl = np.concatenate(itl_parts) if itl_parts else np.empty(0)
    placed = local + remote
    return {
        "policy": policy,
        "sessions": n,
        "completed": completed,
        "failed": n - completed,
        "slo_attainment": attained / n if n else 0.0,
        "goodput_rps": attained / duration_s,
        "local_fraction": local / placed if placed else None,
        "ttft_s": latency_summary(ttft_all),
        "ttft_initial_s": latency_summary(ttft_init),
        "ttft_incremental_s": latency_summary(ttft_incr),
        "itl_s": latency_summary(itl),
        "e2e_s": latency_summary(e2e),
        # extras
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "duration_s": float(duration_s),
        "attained": attained,
        "ttft_attainment": ttft_ok / n if n else 0.0,
        "itl_attainment": itl_ok / n if n else 0.0,
        "rounds": rounds_total,
        "rounds_with_first_token": rounds_done,
        "local_prefills": local,
        "remote_prefills": remote,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration_s,
        "errors": dict(errors.most_common(10)),
    }


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) < 1.0:
        return f"{v * 1000:.1f} ms"
    return f"{v:.3f} s"


def format_report(report: dict) -> str:
    """A compact table for the terminal."""
    n = report.get("sessions", 0)
    lf = report.get("local_fraction")
    slo = report.get("slo") or {}
    lines = [
        f"policy {report.get('policy')}   sessions {n}   completed {report.get('completed')}   "
        f"failed {report.get('failed')}",
    ]
    if slo:
        lines.append(f"SLO  TTFT <= {_fmt_s(slo.get('ttft_s'))}   mean ITL <= {_fmt_s(slo.get('itl_s'))}")
    att = f"SLO attainment {report.get('slo_attainment', 0.0) * 100:.1f} %"
    if "ttft_attainment" in report:
        att += (f"  (TTFT {report['ttft_attainment'] * 100:.1f} %, "
                f"ITL {report['itl_attainment'] * 100:.1f} %)")
    lines.append(att + f"   goodput {report.get('goodput_rps', 0.0):.3f} sessions/s")
    if lf is None:
        lines.append("local prefills  -")
    else:
        extra = ""
        if "local_prefills" in report:
            extra = f"  ({report['local_prefills']} of {report['local_prefills'] + report['remote_prefills']})"
        lines.append(f"local prefills  {lf * 100:.1f} %{extra}")
    lines.append(f"{'latency':<18}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}")
    for key, label in (("ttft_s", "ttft"), ("ttft_initial_s", "  initial"),
                       ("ttft_incremental_s", "  incremental"), ("itl_s", "itl"), ("e2e_s", "e2e")):
        d = report.get(key) or {}
        lines.append(f"{label:<18}" + "".join(f"{_fmt_s(d.get(q)):>11}" for q in ("mean", "p50", "p90", "p99")))
    errs = report.get("errors") or {}
    for msg, count in list(errs.items())[:3]:
        lines.append(f"failed x{count}: {msg[:100]}")
    return "\n".join(lines)
