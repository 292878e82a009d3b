"""Piecewise alpha-beta functions and their least-squares fit.

A :class:`Piecewise` has breakpoints ``b_0 < b_1 < ... < b_k`` and ``k`` pieces; piece ``i``
covers ``[b_i, b_{i+1})`` and evaluates ``alpha[i] + beta[i] * x``. Below ``b_0`` the first piece
is used, at or above ``b_k`` the last one (linear extrapolation).

Evaluation is one binary search (``bisect_right``'s) over the ``k - 1`` inner breakpoints plus one
multiply-add, on tuples built once at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Piecewise", "interpolate_piecewise"]


@dataclass(frozen=True)
class Piecewise:
    """``t = alpha[i] + beta[i] * x`` on piece ``i`` (``breakpoints[i] <= x < breakpoints[i+1]``)."""

    breakpoints: tuple[float, ...]
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    inner: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bps = tuple(float(b) for b in self.breakpoints)
        alpha = tuple(float(a) for a in self.alpha)
        beta = tuple(float(b) for b in self.beta)
        if len(bps) < 2:
            raise ValueError("breakpoints: need at least 2 values (one piece)")
        if any(b1 <= b0 for b0, b1 in zip(bps, bps[1:])):
            raise ValueError(f"breakpoints: must be strictly increasing, got {list(bps)}")
        k = len(bps) - 1
        if len(alpha) != k:
            raise ValueError(f"alpha: need {k} values (one per piece), got {len(alpha)}")
        if len(beta) != k:
            raise ValueError(f"beta: need {k} values (one per piece), got {len(beta)}")
        object.__setattr__(self, "breakpoints", bps)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "inner", bps[1:-1])

    def __call__(self, x: float) -> float:
        return self.at(x)

    def at(self, x: float) -> float:
        """The value at ``x`` (as a call; the performance model's cost functions call this: compiled,
        a method call is direct)."""
        i = self.piece(x)
        return self.alpha[i] + self.beta[i] * x

    def piece(self, x: float) -> int:
        """Index of the piece that evaluates ``x``: ``bisect_right(inner, x)``, its loop written out
        (compiled, native code; ``bisect_right`` is a Python-level call)."""
        inner = self.inner
        lo = 0
        hi = len(inner)
        while lo < hi:
            mid = (lo + hi) // 2
            if x < inner[mid]:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def discontinuities(self) -> list[float]:
        """Jump ``right - left`` at each inner breakpoint (0 for a continuous function)."""
        out = []
        for i, b in enumerate(self.inner):
            left = self.alpha[i] + self.beta[i] * b
            right = self.alpha[i + 1] + self.beta[i + 1] * b
            out.append(right - left)
        return out

    def to_json(self) -> dict:
        bps = [int(b) if b.is_integer() else b for b in self.breakpoints]
        return {"breakpoints": bps, "alpha": list(self.alpha),
                "beta": list(self.beta)}


def interpolate_piecewise(f, breakpoints: Sequence[float]) -> Piecewise:
    """The continuous piecewise-linear interpolant of ``f`` through ``(b, f(b))`` for each breakpoint.

    Used by :mod:`ampd.perf.derive`: exact at every breakpoint and continuous by construction.
    """
    bps = [float(b) for b in breakpoints]
    ys = [float(f(b)) for b in bps]
    alpha, beta = [], []
    for (x0, y0), (x1, y1) in zip(zip(bps, ys), zip(bps[1:], ys[1:])):
        slope = (y1 - y0) / (x1 - x0)
        alpha.append(y0 - slope * x0)
        beta.append(slope)
    return Piecewise(tuple(bps), tuple(alpha), tuple(beta))
