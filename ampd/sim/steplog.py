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
from typing import TYPE_CHECKING, Any, Final, Iterator

from ampd.bench.report import SAMPLE_BLOCK

if TYPE_CHECKING:  # (a cycle: ampd.sim.result imports this module)
    from .result import SimSession

__all__ = ["StepLog", "itl_samples", "ItlPieces", "FirstSteps", "SERIES_POINTS", "pack_row"]

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
    Vectorised with numpy (the same samples as a per-segment loop, tests/unit/test_sim.py), in
    ``ItlPieces``' order: its pieces joined."""
    import numpy as np

    pieces = ItlPieces(step_logs, FirstSteps.of(sessions))
    vals = np.empty(pieces.size)
    wts = np.empty(pieces.size)
    at = 0
    for v, w in pieces():
        e = at + v.size
        vals[at:e] = v
        wts[at:e] = w
        at = e
    return vals, wts


class ItlPieces:
    """The samples of ``itl_samples`` as a callable that yields them as (values, weights) pieces
    of at most ``SAMPLE_BLOCK``, anew at each call: the compact report reads them twice
    (``weighted_summary_of``) without the whole sample in memory (31M samples at paper scale: 500
    MB of fresh pages, which the kernel zeroed in ~0.4 CPU s). In this order: every log's long
    runs (``SAMPLE_BLOCK // SERIES_POINTS`` to a piece, point by point: numpy's loops then run along the
    runs, not 16 points at a time; a piece of ``SAMPLE_BLOCK`` samples, which the report reads without
    copying), then each log's first steps and short runs, then the rounds' first gaps. ``size``:
    the number of samples."""

    def __init__(self, step_logs: list[StepLog], firsts: FirstSteps) -> None:
        import numpy as np

        self.np: Any = np
        self.runs = [_Runs(np, lg) for lg in step_logs if len(lg.lo)]
        # the long runs of all logs, one after the other: (k, A, g, each point's weight)
        self.long = [np.concatenate(col) for col in zip(*[r.long(np) for r in self.runs])]
        self.first_gaps = firsts.gaps(np, step_logs)
        n_long = self.long[0].size if self.long else 0
        self.size: int = n_long * SERIES_POINTS + sum([r.size for r in self.runs]) + self.first_gaps.size

    def __call__(self) -> Iterator[tuple]:
        np = self.np
        if self.long:
            yield from _long_pieces(np, *self.long)
        for runs in self.runs:
            yield from runs.pieces(np)
        fg = self.first_gaps
        for i in range(0, fg.size, SAMPLE_BLOCK):
            v = fg[i:i + SAMPLE_BLOCK]
            yield v, np.ones(v.size)


def _long_pieces(np: Any, k: Any, A: Any, g: Any, w: Any) -> Iterator[tuple]:
    """The long runs' points, ``A + g * (1 + (k - 2) * i / P)`` at ``i = 0.5 .. P - 0.5`` (``P``:
    ``SERIES_POINTS``), each weighted ``w``, for ``SAMPLE_BLOCK // P`` runs at a time, point by point."""
    P = SERIES_POINTS
    B = SAMPLE_BLOCK // P
    pts = (np.arange(P, dtype=np.float64) + 0.5)[:, None]
    for i in range(0, k.size, B):
        out = (k[i:i + B] - 2)[None, :] * pts
        out /= P
        out += 1
        out *= g[i:i + B]
        out += A[i:i + B]
        yield out.ravel(), np.broadcast_to(w[i:i + B], out.shape).ravel()


class _Runs:
    """One step log's runs as ``ItlPieces`` reads them: ``m`` the runs with ``old`` sessions
    (their first step's gap), ``sh`` the short runs (every step j = 1 .. k-1: ``c`` of them) and
    ``lo_`` the long ones (``SERIES_POINTS`` points of the series). ``size``: the samples of
    ``pieces`` (the long runs' are ``long``'s)."""

    def __init__(self, np: Any, lg: StepLog) -> None:
        P = SERIES_POINTS
        self.k = k = np.frombuffer(lg.k, dtype=np.int64)
        self.old = old = np.frombuffer(lg.old, dtype=np.int64)
        self.t0 = np.frombuffer(lg.t0, dtype=np.float64)
        self.A = np.frombuffer(lg.A, dtype=np.float64)
        self.g = np.frombuffer(lg.g, dtype=np.float64)
        self.n = np.frombuffer(lg.n, dtype=np.int64).astype(np.float64)
        self.prev = np.frombuffer(lg.prev, dtype=np.float64)
        self.m = np.nonzero(old)[0]
        self.sh = np.nonzero((k > 1) & (k - 1 <= P))[0]
        self.c = k[self.sh] - 1
        self.lo_ = np.nonzero(k - 1 > P)[0]
        self.size: int = self.m.size + int(self.c.sum())

    def long(self, np: Any) -> tuple:
        """The long runs' (k, A, g, each point's weight), as ``_long_pieces`` takes them."""
        lo_ = self.lo_
        k = self.k[lo_]
        return k.astype(np.float64), self.A[lo_], self.g[lo_], self.n[lo_] * (k - 1) / SERIES_POINTS

    def pieces(self, np: Any) -> Iterator[tuple]:
        """The first steps' gaps, then the short runs'."""
        B = SAMPLE_BLOCK // SERIES_POINTS  # short runs per piece
        A, g, n, m = self.A, self.g, self.n, self.m
        for i in range(0, m.size, SAMPLE_BLOCK):  # a run's first step: one gap for its ``old`` sessions
            mm = m[i:i + SAMPLE_BLOCK]
            yield self.t0[mm] + A[mm] - self.prev[mm], self.old[mm].astype(np.float64)
        for i in range(0, self.sh.size, B):
            sh, c = self.sh[i:i + B], self.c[i:i + B]
            idx = np.repeat(sh, c)
            j = (np.arange(idx.size) - np.repeat(np.cumsum(c) - c, c) + 1).astype(np.float64)
            yield A[idx] + g[idx] * j, n[idx]


class FirstSteps:
    """The rounds with a first gap (two tokens or more) as ``ItlPieces`` reads them: each one's first
    token, decode worker and first step there, in round order. The compact report adds them in its
    own pass over the rounds (a pass over 1.1M rounds scattered over the heap by a 25 s simulation
    costs ~0.3 CPU s, mostly cache misses); ``of`` makes that pass for ``itl_samples``."""

    def __init__(self) -> None:
        self.first: list[float] = []
        self.worker: list[int] = []
        self.step_lo: list[int] = []

    def add(self, first: float, worker: int, step_lo: int) -> None:
        self.first.append(first)
        self.worker.append(worker)
        self.step_lo.append(step_lo)

    @staticmethod
    def of(sessions: list[SimSession]) -> FirstSteps:
        fs = FirstSteps()
        # unpacked: compiled, a named tuple's fields read by position are direct, by name a Python lookup
        for sess in sessions:
            for _, _, ft, _, nt, _, worker, step_lo, _ in sess.rounds:
                if nt > 1:
                    fs.add(ft, worker, step_lo)
        return fs

    def gaps(self, np: Any, step_logs: list[StepLog]) -> Any:
        """Each round's first gap: its first token -> the end of its first decode step."""
        cnt = len(self.first)  # (np.fromiter: a list read as numbers, ~30 % faster than np.array's)
        if not cnt:
            return np.empty(0)
        ends = _first_steps_end(np, step_logs, np.fromiter(self.worker, np.int64, cnt),
                                np.fromiter(self.step_lo, np.int64, cnt))
        return np.subtract(ends, np.fromiter(self.first, np.float64, cnt), out=ends)


def _first_steps_end(np, step_logs, wk_a, lo_a):
    """When each round's first decode step ended, by its worker's step log (``wk_a``: each round's
    decode worker, ``lo_a``: its first step there)."""
    first = np.empty(len(wk_a))
    for w in np.flatnonzero(np.bincount(wk_a)):  # the workers present (np.unique sorted 1.1M rounds)
        sel = wk_a == w
        lg = step_logs[int(w)]
        LO = np.frombuffer(lg.lo, dtype=np.int64)
        lo_w = lo_a[sel]
        s = np.searchsorted(LO, lo_w, side="right") - 1
        jj = (lo_w - LO[s]).astype(np.float64)
        T0 = np.frombuffer(lg.t0, dtype=np.float64)[s]
        AA = np.frombuffer(lg.A, dtype=np.float64)[s]
        GG = np.frombuffer(lg.g, dtype=np.float64)[s]
        first[sel] = T0 + (jj + 1) * AA + GG * jj * (jj + 1) * 0.5
    return first
