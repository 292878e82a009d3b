"""The token times of a run, without one object per token: per decode worker, its runs of steps.

Every decode worker keeps the end time of each of its steps in closed form: a run ("segment") of
steps with a fixed batch starts at a known time and its step ``j`` lasts ``A + g*j``. A round that
joined the batch at global step ``lo`` and made ``n`` tokens has the token times ``first_token,
end(lo), ..., end(lo + n - 2)``. ``itl_samples`` turns the logs into the weighted gap distribution
that the compact report path uses for ITL percentiles (docs/simulator.md, "Reports").
"""
from __future__ import annotations

from array import array
from bisect import bisect_right
from struct import Struct
from typing import Final, TYPE_CHECKING

if TYPE_CHECKING:  # (a cycle: ampd.sim.result imports this module)
    from .result import SimSession

__all__ = ["StepLog", "itl_samples", "SERIES_POINTS", "pack_row"]

# one row of a StepLog (StepLog.FIELDS order) as bytes: pack_row(lo, t0, A, g, k, n, old, prev)
pack_row = Struct("=8d").pack


class StepLog:
    """The decode steps of one worker as runs ("segments") of steps with a fixed batch.

    Segment ``s`` starts at global step index ``lo[s]`` and time ``t0[s]``; its step ``j`` lasts
    ``A[s] + g[s] * j`` (the batch's context grows by ``batch`` tokens a step and ``t_dec`` is
    affine in the context), so step ``j`` ends at ``t0 + (j + 1) * A + g * j * (j + 1) / 2``.
    ``old[s]``: sessions whose previous token came from the step before the segment; ``n[s]``: batch;
    ``prev[s]``: end of the step before the segment (its first gap includes any prefill pause)."""

    __slots__ = ("lo", "t0", "A", "g", "k", "n", "old", "prev", "rows")

    # field order of a row of ``rows``; the integer fields are exact in a double (< 2**53)
    FIELDS = ("lo", "t0", "A", "g", "k", "n", "old", "prev")

    def __init__(self):
        # a running simulation appends each segment as one row of 8 native doubles, packed by
        # ``pack_row`` (one C call per segment: 0.35 us against 0.8 us for array("d").extend of
        # the row's tuple, timeit, Python 3.11); ``finish`` splits the rows into the per-field
        # arrays below
        self.rows = bytearray()
        self.lo = array("q")
        self.t0 = array("d")
        self.A = array("d")
        self.g = array("d")
        self.k = array("q")
        self.n = array("q")
        self.old = array("q")
        self.prev = array("d")

    def finish(self) -> None:
        """Move the rows appended so far into the per-field arrays (idempotent)."""
        if not self.rows:
            return
        import numpy as np

        m = np.frombuffer(self.rows, dtype=np.float64).reshape(-1, 8)
        for i, name in enumerate(self.FIELDS):
            a = getattr(self, name)
            col = m[:, i]
            a.frombytes((col.astype(np.int64) if a.typecode == "q" else np.ascontiguousarray(col)).tobytes())
        del m, col  # the buffer's views, before it shrinks
        self.rows.clear()  # in place: a driver may hold rows.extend

    def step_end(self, idx: int) -> float:
        s = bisect_right(self.lo, idx) - 1
        j = idx - self.lo[s]
        return self.t0[s] + (j + 1) * self.A[s] + self.g[s] * j * (j + 1) * 0.5

    def ends(self, lo: int, count: int) -> list[float]:
        """End times of global steps lo .. lo + count - 1."""
        out = []
        idx = lo
        stop = lo + count
        s = bisect_right(self.lo, idx) - 1
        LO, T0, A, G, K = self.lo, self.t0, self.A, self.g, self.k
        while idx < stop:
            base = LO[s]
            t0, a, g = T0[s], A[s], G[s]
            last = min(stop, base + K[s])
            for i in range(idx, last):
                j = i - base
                out.append(t0 + (j + 1) * a + g * j * (j + 1) * 0.5)
            idx = last
            s += 1
        return out


# at most this many points summarise the gaps inside one run of steps (compact ITL percentiles)
SERIES_POINTS: Final = 16


def itl_samples(step_logs: list[StepLog], sessions: list[SimSession]) -> tuple:
    """Every token gap of a run as (values, weights) numpy arrays, without one entry per token.

    The first step of a run has one gap shared by the ``old`` sessions (it includes any prefill
    pause); step ``j >= 1`` of a run has the gap ``A + g*j`` shared by the whole batch (a long
    run's arithmetic series is summarised by ``SERIES_POINTS`` evenly spaced points carrying
    equal weight); a round's first gap (first token -> its first step) is its own sample.
    Vectorised with numpy (the same samples as a per-segment loop)."""
    import numpy as np

    P = SERIES_POINTS
    # pass 1: per log, the segments of each part; the output is allocated once and filled in
    # place (31M samples at paper scale: no temporaries of that size, no final concatenation)
    plan = []
    size = 0
    for lg in step_logs:
        if not len(lg.lo):
            continue
        k = np.frombuffer(lg.k, dtype=np.int64)
        old = np.frombuffer(lg.old, dtype=np.int64)
        m = np.nonzero(old)[0]
        sh = np.nonzero((k > 1) & (k - 1 <= P))[0]  # short runs: every step j = 1 .. k-1
        c = k[sh] - 1
        lo_ = np.nonzero(k - 1 > P)[0]  # long runs: P evenly spaced points of the series
        nsh = int(c.sum())
        plan.append((lg, k, old, m, sh, c, lo_, size))
        size += m.size + nsh + lo_.size * P
    # the rounds with a gap: their first token, decode worker and first step, in one pass (unpacked:
    # compiled, a named tuple's fields read by position are direct, by name a Python lookup)
    first: list[float] = []
    workers: list[int] = []
    los: list[int] = []
    for sess in sessions:
        for _, _, ft, _, nt, _, worker, step_lo, _ in sess.rounds:
            if nt > 1:
                first.append(ft)
                workers.append(worker)
                los.append(step_lo)
    cnt = len(first)
    vals = np.empty(size + cnt)
    wts = np.empty(size + cnt)
    for lg, k, old, m, sh, c, lo_, at in plan:
        _run_gaps(np, lg, k, old, m, sh, c, lo_, vals, wts, at)
    if cnt:  # each round's first gap: first token -> end of its first step
        ends = _first_steps_end(np, step_logs, np.array(workers, dtype=np.int64), np.array(los, dtype=np.int64))
        np.subtract(ends, np.array(first, dtype=np.float64), out=vals[size:])
        wts[size:] = 1.0
    return vals, wts


def _run_gaps(np, lg, k, old, m, sh, c, lo_, vals, wts, at: int) -> None:
    """One step log's run gaps, written into ``vals``/``wts`` from ``at`` (see itl_samples): ``m``
    the runs with ``old`` sessions, ``sh`` the short runs (``c`` steps after the first), ``lo_``
    the long ones."""
    P = SERIES_POINTS
    t0 = np.frombuffer(lg.t0, dtype=np.float64)
    A = np.frombuffer(lg.A, dtype=np.float64)
    g = np.frombuffer(lg.g, dtype=np.float64)
    n = np.frombuffer(lg.n, dtype=np.int64).astype(np.float64)
    prev = np.frombuffer(lg.prev, dtype=np.float64)
    # the first step of a run: one gap shared by the ``old`` sessions (any prefill pause in it)
    e = at + m.size
    np.subtract(t0[m] + A[m], prev[m], out=vals[at:e])
    wts[at:e] = old[m]
    at = e
    if sh.size:
        idx = np.repeat(sh, c)
        starts = np.cumsum(c) - c
        j = (np.arange(idx.size) - np.repeat(starts, c) + 1).astype(np.float64)
        e = at + idx.size
        np.add(A[idx], g[idx] * j, out=vals[at:e])
        wts[at:e] = n[idx]
        at = e
    if lo_.size:
        kk = k[lo_].astype(np.float64)[:, None]
        i = (np.arange(P, dtype=np.float64) + 0.5)[None, :]
        e = at + lo_.size * P
        out = vals[at:e].reshape(lo_.size, P)
        # A + g * (1 + (k - 2) * i / P), the same operations in place
        np.multiply(kk - 2, i, out=out)
        out /= P
        out += 1
        out *= g[lo_][:, None]
        out += A[lo_][:, None]
        wts[at:e] = np.repeat(n[lo_] * (k[lo_] - 1) / P, P)


def _first_steps_end(np, step_logs, wk_a, lo_a):
    """When each round's first decode step ended, by its worker's step log (``wk_a``: each round's
    decode worker, ``lo_a``: its first step there)."""
    first = np.empty(len(wk_a))
    for w in np.unique(wk_a):
        sel = wk_a == w
        lg = step_logs[int(w)]
        LO = np.frombuffer(lg.lo, dtype=np.int64)
        s = np.searchsorted(LO, lo_a[sel], side="right") - 1
        jj = (lo_a[sel] - LO[s]).astype(np.float64)
        T0 = np.frombuffer(lg.t0, dtype=np.float64)[s]
        AA = np.frombuffer(lg.A, dtype=np.float64)[s]
        GG = np.frombuffer(lg.g, dtype=np.float64)[s]
        first[sel] = T0 + (jj + 1) * AA + GG * jj * (jj + 1) * 0.5
    return first
