"""What the profiler measures and what it accepts: the held-out split and the checks (pure).

Held-out points are measured like the grid but never fitted: the geometric midpoints of neighbouring
l_incr, batch and KV sizes, taken at the arithmetic midpoints of neighbouring l_hist and contexts, so
neither coordinate of a prefill or decode held-out point is on the fitted grid. Their relative error
is the profile's ``held_out_error``; on the fitted points the error says little (two points per piece
fit almost exactly whatever the engine does).

A fitted profile is refused when, for any quantity:
- its held-out error (max over the points) exceeds the threshold (``max_held_out_error``), or
- a piece is negative where the profile is used, or the function falls by more than the threshold
  (relative) inside a piece or across a breakpoint. A smaller dip of a flat piece is noise the
  threshold already allows the profile; a larger one is a measurement or fit the profile cannot use.
Each problem names the quantity, the piece and the measured points behind it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ampd.perf.piecewise import Piecewise

__all__ = ["geo_midpoints", "lin_midpoints", "Plan", "plan_points", "HeldOut", "held_out",
           "shape_problems", "error_problems"]


def _geo(a: int, b: int) -> int:
    return int(round(math.sqrt(a * b)))


def geo_midpoints(xs: Sequence[int]) -> list[int]:
    """The geometric midpoints of neighbouring values that are not grid values themselves."""
    s = sorted(set(xs))
    return sorted({_geo(a, b) for a, b in zip(s, s[1:]) if _geo(a, b) not in s})


def lin_midpoints(xs: Sequence[int]) -> list[int]:
    """The arithmetic midpoints of neighbouring values; with one value, that value (nothing between)."""
    s = sorted(set(xs))
    if len(s) < 2:
        return list(s)
    return sorted({(a + b) // 2 for a, b in zip(s, s[1:]) if (a + b) // 2 not in s})


@dataclass(frozen=True)
class Plan:
    """The points of one TP degree: fitted (``pre``, ``dec``) and held out (``hpre``, ``hdec``)."""

    pre: list[tuple[int, int]]    # (l_hist, l_incr)
    dec: list[tuple[int, int]]    # (batch, context per sequence)
    hpre: list[tuple[int, int]]
    hdec: list[tuple[int, int]]


def plan_points(l_hist: Sequence[int], l_incr: Sequence[int], batch: Sequence[int], context: Sequence[int],
                capacity: int, max_context: int) -> Plan:
    """Grid and held-out points; those whose KV exceeds ``capacity`` or ``max_context`` are left out."""
    def fits_pre(lh: int, li: int) -> bool:
        return lh + li <= min(capacity, max_context)

    def fits_dec(b: int, c: int) -> bool:
        return b * c <= capacity and c <= max_context
    pre = [(lh, li) for lh in l_hist for li in l_incr if fits_pre(lh, li)]
    dec = [(b, c) for c in context for b in batch if fits_dec(b, c)]
    hpre = [(lh, li) for lh in lin_midpoints(l_hist) for li in geo_midpoints(l_incr) if fits_pre(lh, li)]
    hdec = [(b, c) for c in lin_midpoints(context) for b in geo_midpoints(batch) if fits_dec(b, c)]
    return Plan(pre, dec, hpre, hdec)


@dataclass(frozen=True)
class HeldOut:
    """Relative error |model - measured| / measured on held-out points, with the worst ones."""

    max_rel: float
    mean_rel: float
    points: int
    worst: tuple[tuple, ...]   # (point..., measured s, model s, rel) of the largest errors, worst first

    def to_json(self) -> dict:
        return {"max_rel": round(self.max_rel, 6), "mean_rel": round(self.mean_rel, 6), "points": self.points,
                "worst": [[*p[:-3], round(p[-3], 6), round(p[-2], 6), round(p[-1], 4)] for p in self.worst]}


def held_out(samples: Sequence[tuple], model: Callable[..., float], keep: int = 3) -> HeldOut:
    """``samples``: (x..., measured seconds); ``model(*x)`` predicts."""
    rows = []
    for s in samples:
        *x, t = s
        if t > 0:
            m = model(*x)
            rows.append((*x, t, m, abs(m - t) / t))
    if not rows:
        return HeldOut(0.0, 0.0, 0, ())
    rows.sort(key=lambda r: -r[-1])
    errs = [r[-1] for r in rows]
    return HeldOut(errs[0], sum(errs) / len(errs), len(errs), tuple(rows[:keep]))


def _pts(xs_ts: Sequence[tuple[float, float]]) -> str:
    return ", ".join(f"({x:g}, {t * 1e3:.2f} ms)" for x, t in xs_ts) or "none"


def shape_problems(quantity: str, unit: str, f: Piecewise, lo: float, tol: float,
                   points: Sequence[tuple[float, float]]) -> list[str]:
    """Pieces of ``f`` that are negative on [``lo``, last breakpoint] or fall by more than ``tol``.

    ``points``: the measured (x, seconds) behind ``f`` (for a function with shared terms, the
    seconds less those terms), named with the piece they fall in."""
    bps = f.breakpoints
    out = []

    def named(i: int) -> str:
        return f"{quantity} piece {i} [{bps[i]:g}, {bps[i + 1]:g}) {unit}"

    def members(i: int) -> list[tuple[float, float]]:
        return sorted(p for p in points if f.piece(p[0]) == i)

    for i in range(len(bps) - 1):
        a = lo if i == 0 else bps[i]
        b = bps[i + 1]
        va, vb = f.alpha[i] + f.beta[i] * a, f.alpha[i] + f.beta[i] * b
        if min(va, vb) < 0:
            x = a if va < vb else b
            out.append(f"{named(i)} is negative: {min(va, vb) * 1e3:.3f} ms at {x:g} "
                       f"(alpha {f.alpha[i]:.4g} s, beta {f.beta[i]:.4g} s); its points: {_pts(members(i))}")
        elif va - vb > tol * va:
            out.append(f"{named(i)} decreases: {va * 1e3:.3f} ms at {a:g} to {vb * 1e3:.3f} ms at {b:g} "
                       f"({(vb / va - 1):+.1%}); its points: {_pts(members(i))}")
    last = len(bps) - 2
    if f.beta[last] < 0 and not any(named(last) in p for p in out):
        out.append(f"{named(last)} decreases beyond its last breakpoint (beta {f.beta[last]:.4g} s per unit): "
                   f"it extrapolates down; its points: {_pts(members(last))}")
    for i, jump in enumerate(f.discontinuities()):
        b = bps[i + 1]
        left = f.alpha[i] + f.beta[i] * b
        if jump < 0 and -jump > tol * left > 0:
            out.append(f"{quantity} decreases at breakpoint {b:g} {unit}: {left * 1e3:.3f} ms at the end of "
                       f"piece {i}, {(left + jump) * 1e3:.3f} ms at the start of piece {i + 1} "
                       f"({jump / left:+.1%}); their points: {_pts(members(i) + members(i + 1))}")
    return out


def error_problems(quantity: str, err: HeldOut, names: Sequence[str], tol: float) -> list[str]:
    """The held-out error of ``quantity`` above ``tol``, naming its worst points (``names``: the point's
    coordinates)."""
    if err.points == 0:
        return [f"{quantity}: no held-out point was measured, so its error is unknown (grid too small)"]
    if err.max_rel <= tol:
        return []
    worst = "; ".join(
        ", ".join(f"{n}={v:g}" for n, v in zip(names, p[:-3]))
        + f": measured {p[-3] * 1e3:.2f} ms, model {p[-2] * 1e3:.2f} ms ({p[-1]:.1%})"
        for p in err.worst if p[-1] > tol)
    return [f"{quantity}: held-out error {err.max_rel:.1%} (mean {err.mean_rel:.1%} over {err.points} points) "
            f"exceeds {tol:.0%}; {worst}"]
