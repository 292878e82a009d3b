"""SLO accounting shared by the live `ampd bench` and `ampd simulate` (pure; docs/report.md).

Callers record what happened to every session as ``SessionRecord``s (times in seconds on one
clock) and call ``build_report``; both commands therefore judge SLOs by the same rule.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from ampd.slo import SLO

__all__ = ["SLO", "RoundRecord", "SessionRecord", "SessionVerdict", "judge_session",
           "build_report", "format_report", "latency_summary", "weighted_latency_summary", "weighted_summary_of",
           "REPORT_KEYS", "EPS_S", "assemble_report", "SAMPLE_BLOCK"]

# Comparisons with a threshold allow this much float noise (far below any meaningful latency).
EPS_S = 1e-9

REPORT_KEYS = ("policy", "sessions", "completed", "failed", "slo_attainment", "goodput_rps",
               "local_fraction", "ttft_s", "ttft_initial_s", "ttft_incremental_s", "itl_s", "e2e_s")


# Not frozen (treated as a value all the same): a frozen dataclass sets its 12 fields through
# object.__setattr__, ~4x slower to build, and a paper-scale simulation reports ~1.1M rounds.
@dataclass(slots=True)
class RoundRecord:
    """What happened in one round. ``input_ready``: arrival (round 0) or tool result time;
    ``first_token``: None if it never came; ``token_times``: every token of the round including
    the first; ``local``: prefill ran on the decode worker (True), a prefill worker (False) or
    unknown (None); ``l_hist``/``l_incr``: the prefill task's sizes (informational).

    Compact form (when token times are not kept, e.g. paper-scale simulations): leave
    ``token_times`` empty and give ``n_tokens`` (tokens of the round, the first included),
    ``last_token`` (time of its last token) and optionally the ITL aggregates ``itl_sum`` (sum of
    the round's token gaps) and ``itl_count`` (number of gaps). Without ``itl_count`` the gaps are
    ``last_token - first_token`` over ``n_tokens - 1``. These fields are ignored whenever
    ``token_times`` is not empty."""

    session_id: str
    round: int
    input_ready: float
    first_token: float | None
    token_times: tuple[float, ...]
    local: bool | None
    l_hist: int = 0
    l_incr: int = 0
    n_tokens: int | None = None
    last_token: float | None = None
    itl_sum: float = 0.0
    itl_count: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.input_ready

    @property
    def end(self) -> float | None:
        """Time of the round's last token (``last_token`` in the compact form; its first token if
        neither was kept)."""
        if self.token_times:
            return self.token_times[-1]
        if self.last_token is not None:
            return self.last_token
        return self.first_token

    @property
    def tokens(self) -> int:
        """Tokens of the round: ``len(token_times)``, else ``n_tokens`` (0 when unknown)."""
        if self.token_times:
            return len(self.token_times)
        return self.n_tokens or 0

    def gaps(self) -> tuple[float, int]:
        """(sum of the round's token gaps, number of gaps)."""
        tt = self.token_times
        if tt:
            n = len(tt)
            return (tt[-1] - tt[0], n - 1) if n >= 2 else (0.0, 0)
        if self.itl_count > 0:
            return float(self.itl_sum), int(self.itl_count)
        nt = self.n_tokens
        if nt is not None and nt >= 2 and self.first_token is not None and self.last_token is not None:
            return self.last_token - self.first_token, nt - 1
        return 0.0, 0


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
    """docs/report.md "The rule": a session attains the SLO when it completed, every round's TTFT
    (first_token - input_ready) <= ttft_s and its mean ITL (all gaps between consecutive tokens
    within rounds, across its rounds) <= itl_s."""
    ttft_ok = bool(s.rounds) and all(
        r.first_token is not None and r.first_token - r.input_ready <= slo.ttft_s + EPS_S
        for r in s.rounds)
    span = 0.0
    gaps = 0
    for r in s.rounds:
        a, k = r.gaps()   # the sum of the round's gaps (span of its tokens) and their number
        span += a
        gaps += k
    mean_itl = span / gaps if gaps else None
    itl_ok = mean_itl is None or mean_itl <= slo.itl_s + EPS_S
    return SessionVerdict(ttft_ok, itl_ok, mean_itl, bool(s.completed) and ttft_ok and itl_ok)


def latency_summary(samples) -> dict:
    """{"mean", "p50", "p90", "p99"} (numpy linear interpolation); all None without samples."""
    import numpy as np  # imported here: a planner run does not pay for it

    a = np.asarray(samples, dtype=float)
    if a.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def weighted_latency_summary(values, weights) -> dict:
    """``latency_summary`` of a weighted sample: value ``v[i]`` counted ``w[i]`` times (weights
    >= 0, need not be integers). Percentiles interpolate linearly between order statistics as
    numpy's default does, so integer weights give exactly ``latency_summary`` of the repeated
    sample (up to float rounding). The percentiles are selected, not sorted for
    (``_first_reaching``)."""
    import numpy as np  # imported here: a planner run does not pay for it

    v = np.asarray(values, dtype=float).ravel()
    w = np.asarray(weights, dtype=float).ravel()
    if v.shape != w.shape:
        raise ValueError(f"values and weights differ in length ({v.size} != {w.size})")
    return weighted_summary_of(lambda: ((v, w),))


def weighted_summary_of(pieces) -> dict:
    """``weighted_latency_summary`` of the sample that ``pieces()`` yields as (values, weights)
    numpy float arrays of any sizes (the same pieces at every call; they are read twice), so that
    a large sample need not be in memory whole (the simulator's ``ItlPieces``). Every sum runs
    over blocks of ``SAMPLE_BLOCK`` samples (``_blocks``), so the numbers do not depend on how the
    sample is cut into pieces: they equal ``weighted_latency_summary`` of it joined."""
    import numpy as np

    hist = _Histogram(np, pieces)
    if not math.isfinite(hist.n) or hist.w_min < 0:  # an infinite or NaN weight makes the sum so
        raise ValueError("weights must be finite and >= 0")
    n = hist.n
    if n <= 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ranks = []
    for q in (50, 90, 99):
        h = (n - 1) * q / 100.0 if n > 1 else 0.0   # 0-based rank, as np.percentile "linear"
        lo = math.floor(h)
        hi = min(lo + 1, n - 1) if n > 1 else 0
        ranks += [lo + 1 - 1e-9, hi + 1 - 1e-9]
    at = _first_reaching(np, pieces, hist, ranks)
    out = {"mean": hist.dot / n}
    for i, q in enumerate((50, 90, 99)):
        h = (n - 1) * q / 100.0 if n > 1 else 0.0
        a, b = at[2 * i], at[2 * i + 1]
        out[f"p{q}"] = float(a + (b - a) * (h - math.floor(h)))
    return out


# weighted_summary_of reads a sample in blocks of this many (temporaries of 2 MB that malloc
# reuses, where ones the size of a 31M sample cost a page fault and a zeroed page per 4 KB); the
# simulator's ItlPieces yields pieces of this size, which it then reads without copying
SAMPLE_BLOCK = 1 << 18
# _first_reaching sorts a sample this small whole
_SORT_WHOLE = 1 << 16
# a value's bucket: its float's bits less the last _BUCKET_SHIFT (the sign, the exponent and 10
# bits of mantissa: a bucket spans 1/1024 of a power of two)
_BUCKET_SHIFT = 42
_MAGNITUDE = (1 << 63) - 1


def _blocks(np, pieces):
    """The (values, weights) of ``pieces()`` in blocks of ``SAMPLE_BLOCK`` (the last one shorter), in
    order; a block is valid until the next one is asked for (one staging buffer, reused)."""
    vb, wb = np.empty(SAMPLE_BLOCK), np.empty(SAMPLE_BLOCK)
    fill = 0
    for v, w in pieces():
        i = 0
        while i < v.size:
            if not fill and v.size - i >= SAMPLE_BLOCK:  # a whole block of the piece: no copy
                yield v[i:i + SAMPLE_BLOCK], w[i:i + SAMPLE_BLOCK]
                i += SAMPLE_BLOCK
                continue
            take = min(SAMPLE_BLOCK - fill, v.size - i)
            vb[fill:fill + take] = v[i:i + take]
            wb[fill:fill + take] = w[i:i + take]
            fill += take
            i += take
            if fill == SAMPLE_BLOCK:
                yield vb, wb
                fill = 0
    if fill:
        yield vb[:fill], wb[:fill]


def _bucket_ids(np, v, out):
    """The bucket of each value of a block, into ``out`` (int64, ``SAMPLE_BLOCK`` long). As an integer a
    non-negative float's bits grow with its value (a negative one's do with all but the sign bit
    flipped), so buckets are ordered as their values are: a shift per value (and 3 operations
    where a sign bit may be set), where a binary search among bucket edges took 15 ns."""
    bits = v.view(np.int64)
    out = out[:v.size]
    if v.min() > 0:
        return np.right_shift(bits, _BUCKET_SHIFT, out=out)
    np.right_shift(bits, 63, out=out)
    out &= _MAGNITUDE
    out ^= bits
    return np.right_shift(out, _BUCKET_SHIFT, out=out)


class _Histogram:
    """One pass over a sample's blocks: its size, weight ``n``, least weight, largest value,
    weighted sum ``dot`` (einsum, not np.dot: OpenBLAS's dot wakes its threads, which then spin
    ~0.1 CPU s after it returns), whether a value is NaN, and ``weights[i]``, the weight of
    bucket ``base + i`` (from the least bucket seen to the largest)."""

    def __init__(self, np, pieces) -> None:
        self.size = 0
        self.n = self.dot = 0.0
        self.w_min = math.inf
        self.hi = -math.inf
        self.nan = False
        self.base = 0
        self.weights = np.zeros(0)
        self.ids = np.empty(SAMPLE_BLOCK, np.int64)
        for v, w in _blocks(np, pieces):
            self.size += v.size
            self.n += float(w.sum())
            self.dot += float(np.einsum("i,i", v, w))
            self.w_min = min(self.w_min, float(w.min()))
            hi = float(v.max())
            self.nan = self.nan or math.isnan(hi)
            self.hi = max(self.hi, hi)
            self._add(np, _bucket_ids(np, v, self.ids), w)

    def _add(self, np, ids, w) -> None:
        lo, hi = int(ids.min()), int(ids.max())
        end = self.base + self.weights.size
        if not self.weights.size:
            self.base, self.weights = lo, np.zeros(hi + 1 - lo)
        elif lo < self.base or hi >= end:  # the buckets seen grow
            base = min(lo, self.base)
            grown = np.zeros(max(hi + 1, end) - base)
            grown[self.base - base:end - base] = self.weights
            self.base, self.weights = base, grown
        ids -= lo
        self.weights[lo - self.base:hi + 1 - self.base] += np.bincount(ids, weights=w, minlength=hi + 1 - lo)


def _first_reaching(np, pieces, h: _Histogram, ranks) -> list[float]:
    """For each rank r: the smallest value x of the sample whose weight at or below it (the sum of
    ``w[v <= x]``) reaches r, that is the value at r of the weighted sorted sample; the largest
    value when none does (float rounding of the weights' sum).

    Without sorting the whole sample (the simulator's 100k-session report has 31M samples): from
    the weight of each bucket (``_Histogram``), only the buckets the ranks fall in are gathered
    and sorted. The same values as sorting everything, up to the float rounding of the weight
    sums (summed by bucket instead of one running sum)."""
    if h.size <= _SORT_WHOLE or h.nan:  # NaN: no bucket order to keep
        v, w = _join(np, [(v.copy(), w.copy()) for v, w in _blocks(np, pieces)])
        run = _sorted_run(np, v, w, 0.0)
        return [_pick(np, run, r) for r in ranks]
    cum = np.cumsum(h.weights)
    want = [int(np.searchsorted(cum, r)) for r in ranks]
    members = _members(np, pieces, {h.base + b for b in want if b < cum.size}, h.ids)
    out = []
    done: dict[int, tuple] = {}  # bucket -> (its values sorted, their running weight)
    for r, b in zip(ranks, want):
        if b >= cum.size:
            out.append(h.hi)
            continue
        got = done.get(b)
        if got is None:
            v, w = members[h.base + b]
            got = done[b] = _sorted_run(np, v, w, float(cum[b - 1]) if b else 0.0)
        out.append(_pick(np, got, r))
    return out


def _members(np, pieces, buckets: set[int], ids_buf) -> dict:
    """bucket -> (values, weights) of the sample's members of it, in sample order, for each of
    ``buckets``."""
    parts: dict[int, list] = {b: [] for b in buckets}
    for v, w in _blocks(np, pieces):
        ids = _bucket_ids(np, v, ids_buf)
        for b in buckets:
            hit = ids == b
            if hit.any():
                parts[b].append((v[hit], w[hit]))
    return {b: _join(np, p) for b, p in parts.items()}


def _join(np, pairs: list) -> tuple:
    """(values, weights) pairs of arrays, joined."""
    if not pairs:
        return np.empty(0), np.empty(0)
    return np.concatenate([v for v, _ in pairs]), np.concatenate([w for _, w in pairs])


def _sorted_run(np, v, w, base: float) -> tuple:
    """``v`` sorted and the running weight along it, from ``base``."""
    o = np.argsort(v)  # tie order does not matter (tied values are equal): no stable sort
    return v[o], base + np.cumsum(w[o])


def _pick(np, run: tuple, r: float) -> float:
    """The first value of a ``_sorted_run`` whose running weight reaches ``r`` (else its last)."""
    sv, cum = run
    return float(sv[min(int(np.searchsorted(cum, r)), sv.size - 1)])


def build_report(policy: str, sessions: Sequence[SessionRecord], slo: SLO, duration_s: float,
                 *, itl_samples=None) -> dict:
    """The report of docs/report.md (its keys first, then extras).

    ``itl_s`` comes from the gaps of every round's ``token_times``; a compact round (no token
    times, ``itl_count``/``n_tokens`` gaps) contributes its mean gap weighted by its gap count.
    ``itl_samples=(values, weights)``, when given, replaces all of that for the ITL percentiles
    and mean (a weighted gap distribution the caller computed, e.g. the simulator's step log);
    the SLO verdicts always use each session's own gaps.

    Latency samples come from every round that has them, including rounds of sessions that later
    failed; ``e2e_s`` (last token of the last round minus arrival) only from completed sessions.
    ``slo_attainment`` and ``goodput_rps`` count attaining sessions over all sessions and over
    ``duration_s`` respectively."""
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    t = _Tally(want_gaps=itl_samples is None)
    for s in sessions:
        t.session(s, slo)
    if itl_samples is not None:
        values, weights = itl_samples
        itl_summary = weighted_latency_summary(values, weights)
    else:
        itl_summary = t.itl_summary()
    return assemble_report(policy, slo, duration_s, n=len(sessions), completed=t.completed, attained=t.attained,
                           ttft_ok=t.ttft_ok, itl_ok=t.itl_ok, local=t.local, remote=t.remote, ttft_all=t.ttft_all,
                           ttft_init=t.ttft_init, ttft_incr=t.ttft_incr, itl_summary=itl_summary, e2e=t.e2e,
                           rounds_total=t.rounds_total, rounds_done=t.rounds_done, tokens=t.tokens, errors=t.errors)


class _Tally:
    """What ``build_report`` counts over the sessions and their rounds. ``want_gaps``: collect the
    rounds' token gaps for the ITL percentiles (not when the caller gives its own samples)."""

    __slots__ = ("np", "want_gaps", "completed", "attained", "ttft_ok", "itl_ok", "local", "remote", "ttft_all",
                 "ttft_init", "ttft_incr", "itl_parts", "compact_vals", "compact_wts", "e2e", "rounds_total",
                 "rounds_done", "tokens", "errors")

    def __init__(self, want_gaps: bool) -> None:
        import numpy  # imported here: a planner run does not pay for it

        self.np = numpy
        self.want_gaps = want_gaps
        self.completed = self.attained = self.ttft_ok = self.itl_ok = 0
        self.local = self.remote = 0
        self.rounds_total = self.rounds_done = self.tokens = 0
        self.ttft_all: list[float] = []
        self.ttft_init: list[float] = []
        self.ttft_incr: list[float] = []
        self.itl_parts: list = []  # numpy arrays of token gaps
        self.compact_vals: list[float] = []
        self.compact_wts: list[int] = []
        self.e2e: list[float] = []
        self.errors: Counter[str] = Counter()

    def session(self, s: SessionRecord, slo: SLO) -> None:
        v = judge_session(s, slo)
        self.completed += bool(s.completed)
        self.attained += v.attained
        self.ttft_ok += v.ttft_ok
        self.itl_ok += v.itl_ok
        if not s.completed:
            self.errors[s.error or "incomplete"] += 1
        for r in s.rounds:
            self.round(r)
        if s.completed and s.rounds:
            end = s.rounds[-1].end
            if end is not None:
                self.e2e.append(end - s.arrival)

    def round(self, r) -> None:
        self.rounds_total += 1
        if r.local is True:
            self.local += 1
        elif r.local is False:
            self.remote += 1
        if r.first_token is not None:
            t = r.first_token - r.input_ready
            self.ttft_all.append(t)
            (self.ttft_init if r.round == 0 else self.ttft_incr).append(t)
            self.rounds_done += 1
        tt = r.token_times
        if tt:
            self.tokens += len(tt)
            if self.want_gaps and len(tt) >= 2:
                self.itl_parts.append(self.np.diff(self.np.asarray(tt, dtype=float)))
        else:
            self.tokens += r.n_tokens or 0
            if self.want_gaps:
                a, k = r.gaps()
                if k:
                    self.compact_vals.append(a / k)
                    self.compact_wts.append(k)

    def itl_summary(self) -> dict:
        """The ITL percentiles and mean of the gaps collected (a compact round's mean gap weighted
        by its gap count)."""
        np = self.np
        itl = np.concatenate(self.itl_parts) if self.itl_parts else np.empty(0)
        if self.compact_vals:
            return weighted_latency_summary(np.concatenate([itl, self.compact_vals]),
                                            np.concatenate([np.ones(itl.size), self.compact_wts]))
        return latency_summary(itl)


def assemble_report(policy: str, slo: SLO, duration_s: float, *, n: int, completed: int, attained: int,
                    ttft_ok: int, itl_ok: int, local: int, remote: int, ttft_all, ttft_init, ttft_incr,
                    itl_summary: dict, e2e, rounds_total: int, rounds_done: int, tokens: int,
                    errors: Counter) -> dict:
    """The report dict from the counts and samples ``build_report`` gathers (the simulator's
    ``compact_report`` gathers them without records and calls this too)."""
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
        "itl_s": itl_summary,
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
