"""Fitting the piecewise alpha-beta cost functions to measured times (the profiler's pure core).

Model (the form of docs/perf-model.md, the one ``Profile`` evaluates):

* prefill ``t = P(l_incr) + hist * l_hist + attn * l_incr * (l_hist + l_incr / 2)``
* decode  ``t = D(batch) + ctx * context_tokens``
* KV      ``t = K(bytes per link)``

``P``, ``D`` and ``K`` are piecewise linear (alpha + beta x per piece); ``hist``, ``attn`` and ``ctx``
are one coefficient each. Prefill and decode are one joint linear least-squares problem each (the
pieces' alphas and betas plus the shared coefficients), so the shared terms are fitted on every
sample. A shared coefficient that comes out negative (noise on a term that is ~0) is fixed at 0 and
the rest refitted: the profile format requires it >= 0.

Two ways to fit, by what produced the times (``monotone``):

* exact (default): pieces fitted independently, in absolute seconds. Right for the mock engine, whose
  times are a profile of this very form (pieces may jump at a breakpoint); the fit recovers it.
* ``monotone=True``: for an engine that computes. Its time cannot fall as tokens or sequences grow,
  and on a shared CPU each point carries a few % of noise; fitted independently, two noisy points per
  piece give pieces that jump down at a breakpoint or slope down (a profile the checks must refuse).
  So ``P``, ``D`` and ``K`` are fitted continuous and non-decreasing (an intercept and one slope per
  piece, all >= 0: non-negative least squares over hinge columns), with the shared terms >= 0 in the
  same problem, and each row weighted by 1 / measured: the fit minimises relative error, the error
  the held-out check judges, so a 10 ms point counts as much as a 1 s one.

Breakpoints (``breakpoints_for``): every other distinct measured x, so each piece holds two measured
x values (three at the end when their count is odd). With powers of two on the grid, a piece spans a
factor of four; a kink between two measured x values is followed to within the grid's resolution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .piecewise import Piecewise

__all__ = ["fit_piecewise", "breakpoints_for", "fit_prefill", "fit_decode", "fit_kv", "FitError", "rel_errors", "nnls"]


def fit_piecewise(samples: Iterable[tuple[float, float]], breakpoints: Sequence[float],
                  *, min_samples: int = 2) -> Piecewise:
    """Least-squares ``alpha``/``beta`` per piece from measured ``(x, t)`` samples.

    Each sample goes to the piece that would evaluate it (the same rule as :meth:`Piecewise.__call__`,
    so samples below the first or above the last breakpoint join the end pieces). Every piece needs
    at least ``min_samples`` samples at two or more distinct ``x``; otherwise ``ValueError`` names the
    piece. The pieces are fitted independently (no continuity constraint): a profiler should sample
    each bucket densely enough, and the continuity of the result can be checked with
    :meth:`Piecewise.discontinuities`.
    """
    import numpy as np

    bps = tuple(float(b) for b in breakpoints)
    shell = Piecewise(bps, (0.0,) * (len(bps) - 1), (0.0,) * (len(bps) - 1))  # validates bps
    pts = np.asarray([(float(x), float(t)) for x, t in samples], dtype=float).reshape(-1, 2)
    idx = np.searchsorted(np.asarray(shell.inner), pts[:, 0], side="right")
    alpha, beta = [], []
    for i in range(len(bps) - 1):
        sel = pts[idx == i]
        lo, hi = bps[i], bps[i + 1]
        if len(sel) < max(2, min_samples) or np.unique(sel[:, 0]).size < 2:
            raise ValueError(
                f"piece {i} [{lo:g}, {hi:g}): need >= {max(2, min_samples)} samples at >= 2 distinct x, "
                f"got {len(sel)}")
        a_mat = np.column_stack([np.ones(len(sel)), sel[:, 0]])
        (a, b), *_ = np.linalg.lstsq(a_mat, sel[:, 1], rcond=None)
        alpha.append(float(a))
        beta.append(float(b))
    return Piecewise(bps, tuple(alpha), tuple(beta))


@dataclass(frozen=True)
class FitError:
    """Relative error |model - measured| / measured over a set of points."""

    max_rel: float
    mean_rel: float
    points: int

    def to_json(self) -> dict:
        return {"max_rel": round(self.max_rel, 6), "mean_rel": round(self.mean_rel, 6), "points": self.points}


def rel_errors(pairs: Sequence[tuple[float, float]]) -> FitError:
    """``pairs`` of (model, measured) seconds."""
    errs = [abs(m - t) / t for m, t in pairs if t > 0]
    if not errs:
        return FitError(0.0, 0.0, 0)
    return FitError(max(errs), sum(errs) / len(errs), len(errs))


def breakpoints_for(xs: Sequence[float]) -> tuple[float, ...]:
    """Every other distinct x (the first included); the last x closes the last piece."""
    d = sorted(set(float(x) for x in xs))
    if len(d) < 2:
        raise ValueError(f"need >= 2 distinct values to fit a piecewise function, got {d}")
    bps = d[0::2]
    if bps[-1] != d[-1]:  # even count: the last x closes the last piece (x at or above it joins that piece)
        bps.append(d[-1])
    return tuple(bps)


def _joint_lstsq(rows, bps, shared_cols):
    """Least squares over per-piece (alpha, beta) of x plus ``shared_cols`` extra columns.

    ``rows``: (x, extras tuple, t). Returns (alpha, beta, shared) with negative shared terms fixed at 0."""
    import numpy as np

    shell = Piecewise(bps, (0.0,) * (len(bps) - 1), (0.0,) * (len(bps) - 1))
    k = len(bps) - 1
    x = np.array([r[0] for r in rows], dtype=float)
    ex = np.array([r[1] for r in rows], dtype=float).reshape(len(rows), shared_cols)
    t = np.array([r[2] for r in rows], dtype=float)
    piece = np.searchsorted(np.asarray(shell.inner), x, side="right")
    for i in range(k):
        if np.unique(x[piece == i]).size < 2:
            raise ValueError(f"piece {i} [{bps[i]:g}, {bps[i + 1]:g}): needs samples at >= 2 distinct x")
    active = list(range(shared_cols))
    while True:
        cols = []
        for i in range(k):
            on = (piece == i).astype(float)
            cols += [on, on * x]
        cols += [ex[:, j] for j in active]
        coef, *_ = np.linalg.lstsq(np.column_stack(cols), t, rcond=None)
        shared = dict(zip(active, coef[2 * k:]))
        neg = [j for j, v in shared.items() if v < 0]
        if not neg:
            break
        active = [j for j in active if j not in neg]
    alpha = tuple(float(coef[2 * i]) for i in range(k))
    beta = tuple(float(coef[2 * i + 1]) for i in range(k))
    return alpha, beta, tuple(float(shared.get(j, 0.0)) for j in range(shared_cols))


def nnls(a, b, max_iter: int = 0):
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method; the problems here
    have a few dozen columns at most)."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(a.shape)
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (b - a @ x)
        free = ~passive & (w > tol)
        if not free.any():
            break
        passive[int(np.argmax(np.where(free, w, -np.inf)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def _monotone_lstsq(rows, bps, shared_cols):
    """Continuous, non-decreasing piecewise function of x plus ``shared_cols`` terms >= 0, fitted for
    relative error. ``rows``: (x, extras tuple, t > 0). Returns (alpha, beta, shared) per piece."""
    import numpy as np

    k = len(bps) - 1
    x = np.array([r[0] for r in rows], dtype=float)
    ex = np.array([r[1] for r in rows], dtype=float).reshape(len(rows), shared_cols)
    t = np.array([r[2] for r in rows], dtype=float)
    if (t <= 0).any():
        raise ValueError("a monotone fit needs every measured time > 0")
    # the part of x in piece i: 0 before it, its width after it (the last is open). The first piece
    # starts at 0, not at the first measured x: the function is then >= 0 down to 0 (a Piecewise
    # extrapolates its first piece below its first breakpoint, as for one token of a KV read)
    starts = [0.0, *bps[1:-1]]
    cols = [np.ones_like(x)]
    for i in range(k):
        hi = np.inf if i == k - 1 else bps[i + 1] - starts[i]
        cols.append(np.clip(x - starts[i], 0.0, hi))
    cols += [ex[:, j] for j in range(shared_cols)]
    a = np.column_stack(cols) / t[:, None]
    norm = np.linalg.norm(a, axis=0)
    norm[norm == 0] = 1.0
    coef = nnls(a / norm, np.ones_like(t)) / norm  # unit columns: the active set is chosen by scale-free gains
    base, slopes, shared = coef[0], coef[1:1 + k], coef[1 + k:]
    alpha, beta, at = [], [], base  # at: the value at the start of piece i
    for i in range(k):
        beta.append(float(slopes[i]))
        alpha.append(float(at - slopes[i] * starts[i]))
        if i < k - 1:
            at += slopes[i] * (bps[i + 1] - starts[i])
    return tuple(alpha), tuple(beta), tuple(float(v) for v in shared)


def fit_prefill(samples: Sequence[tuple[int, int, float]], *, monotone: bool = False):
    """(l_hist, l_incr, seconds) samples -> (P, hist_s_per_token, attn_s_per_token2)."""
    bps = breakpoints_for([li for _, li, _ in samples])
    rows = [(li, (lh, li * (lh + li / 2)), t) for lh, li, t in samples]
    alpha, beta, (hist, attn) = (_monotone_lstsq if monotone else _joint_lstsq)(rows, bps, 2)
    return Piecewise(bps, alpha, beta), hist, attn


def fit_decode(samples: Sequence[tuple[int, int, float]], *, monotone: bool = False):
    """(batch, context_tokens, seconds) samples -> (D, ctx_s_per_token)."""
    bps = breakpoints_for([b for b, _, _ in samples])
    rows = [(b, (ctx,), t) for b, ctx, t in samples]
    alpha, beta, (ctx,) = (_monotone_lstsq if monotone else _joint_lstsq)(rows, bps, 1)
    return Piecewise(bps, alpha, beta), ctx


def fit_kv(samples: Sequence[tuple[float, float]], *, monotone: bool = False) -> Piecewise:
    """(bytes per link, seconds) samples -> K."""
    bps = breakpoints_for([x for x, _ in samples])
    if monotone:
        alpha, beta, _ = _monotone_lstsq([(x, (), t) for x, t in samples], bps, 0)
        return Piecewise(bps, alpha, beta)
    return fit_piecewise(samples, bps)
