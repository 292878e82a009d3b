"""How the profiler times its points on a shared machine, and re-times the ones the held-out check
doubts (pure: it awaits the calls it is given and touches nothing else).

Three rules, each against the noise of a machine other work shares (a 2-core box at load 3-8 here):

- **A point's time is the minimum of its runs** (``best``), where each run is timed from before its
  work starts to after it ends. The same computation on the same inputs
  does the same work at every run; other processes taking the cores, evicting the caches or
  delaying a wake-up only ever add time, so the fastest run is the one nearest the engine's own cost,
  and one slow run (a burst of load, a first run's allocations) cannot move it. The median of 2-3 runs
  that this replaced moves with the first burst that hits half of them: at load 3-6 a prefill's
  runs ranged 58-208 ms, and the held-out check refused 16-25 % errors that were the load's.
- **Passes go over the points in a shuffled order** (``pass_order``, a fixed seed, a new order per
  pass), so fitted and held-out points share every stretch of a pass: a burst of load spoils some of
  each, never only the held-out points timed together at a pass's end.
- **A bounded re-measure** (``settle``): where a quantity's held-out error is over the limit, its
  failing held-out points and the fitted points around them (``neighbours``) get ``reps`` more runs
  each, and the fit is judged again, at most ``rounds`` times. Noise that came and went is outrun
  (each new run can only lower a point's time to nearer its cost); an engine the model does not fit
  stays refused, since more runs cannot bring its cost onto the model (a round that made no point
  faster is the last: another would not either).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from ampd.profiler.checks import HeldOut

__all__ = ["Timed", "Rotation", "Series", "best", "pass_order", "neighbours", "time_points", "doubted", "settle", "Round"]


class Timed(float):
    """Seconds a call timed itself (only part of what it did counts), returned instead of its result."""


def best(runs: Sequence[float]) -> float:
    """A point's time from its runs: the fastest (noise only adds time; see the module doc)."""
    if not runs:
        raise ValueError("runs: a point needs at least one timed run")
    return min(runs)


def pass_order(n: int, rep: int, seed: int = 0) -> list[int]:
    """The order of ``n`` points in pass ``rep``: a permutation fixed by (seed, rep), new at each pass."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + rep).shuffle(order)
    return order


def neighbours(point: tuple, fitted: Sequence[tuple]) -> list[tuple]:
    """The fitted points around ``point``: per coordinate, the nearest fitted value at or below it and the
    nearest at or above it, and each fitted point whose every coordinate is one of those."""
    around = []
    for j, x in enumerate(point):
        vals = sorted({f[j] for f in fitted})
        lo = [v for v in vals if v <= x]
        hi = [v for v in vals if v >= x]
        around.append({v for v in (lo[-1] if lo else None, hi[0] if hi else None) if v is not None})
    return [f for f in fitted if all(f[j] in around[j] for j in range(len(point)))]


@dataclass
class Rotation:
    """Places in a region of ``span`` positions for successive uses of ``n`` each: each starts where the
    last ended (aligned up to ``align``), from 0 again when the next would pass the end. Reads that rotate
    over a region larger than the CPU's caches find none of their bytes cached by an earlier read."""

    span: int
    align: int = 1
    at: int = 0

    def take(self, n: int) -> int:
        if n > self.span:
            raise ValueError(f"n: {n} positions do not fit a region of {self.span}")
        start = self.at if self.at + n <= self.span else 0
        self.at = start + -(-n // self.align) * self.align
        return start


@dataclass
class Series:
    """One quantity's points: fitted keys first, then held-out keys; the call that times each (an
    awaitable of seconds, or of a :class:`Timed`), and every run so far. ``sample(key, seconds)`` is the
    (x..., seconds) the fit takes (a decode key (batch, context) becomes (batch, context tokens))."""

    keys: list[tuple]
    n_fit: int
    calls: list[Callable[[], Awaitable]]
    sample: Callable[[tuple, float], tuple] = lambda key, s: (*key, s)
    reps: int = 1             # runs of each point per timing (and per re-measure round)
    stat: Callable[[Sequence[float]], float] = best  # a point's time from its runs
    overhead: float = 0.0     # seconds of every run that are the harness's (the mock's wake-up latency)
    runs: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.runs = self.runs or [[] for _ in self.keys]

    def time_of(self, i: int) -> float:
        return max(self.stat(self.runs[i]) - self.overhead, 0.0)

    def samples(self) -> tuple[list[tuple], list[tuple]]:
        """(fitted, held-out) samples at each point's time so far."""
        out = [self.sample(k, self.time_of(i)) for i, k in enumerate(self.keys)]
        return out[: self.n_fit], out[self.n_fit:]

    def around(self, doubted: Sequence[tuple]) -> list[int]:
        """Indices of the points behind ``doubted`` samples (as ``samples`` gives them, seconds last): a
        held-out point with the fitted points around it, a fitted point alone."""
        fit, held = self.samples()
        at = {tuple(s[:-1]): i for i, s in enumerate(fit + held)}
        fitted = self.keys[: self.n_fit]
        out: set[int] = set()
        for s in doubted:
            i = at.get(tuple(s[:-1]))
            if i is None:
                continue
            out.add(i)
            if i >= self.n_fit:
                out |= {fitted.index(f) for f in neighbours(self.keys[i], fitted)}
        return sorted(out)


async def time_points(series: Series, which: Sequence[int], reps: int,
                      tick: Callable[[], None] = lambda: None) -> None:
    """``reps`` more runs of each point in ``which``, in passes over them in a shuffled order."""
    which = list(which)
    for rep in range(reps):
        start = len(series.runs[which[0]]) if which else 0  # a point's runs so far: a new order per pass
        for j in pass_order(len(which), start + rep):
            i = which[j]
            t0 = time.perf_counter()
            got = await series.calls[i]()
            series.runs[i].append(float(got) if isinstance(got, Timed) else time.perf_counter() - t0)
            tick()


def doubted(held: HeldOut, own: HeldOut, tol: float) -> list[tuple]:
    """The points to re-time of a quantity whose held-out error exceeds ``tol``: its held-out points over
    it, and fitted points the fit misses by more than half of it. The fit joins a quantity's pieces and
    shares terms across all its points, so one slow fitted point far from the failing held-out point
    (a decode step of batch 1 spoiled by load) can bend the fit there; at ``tol`` / 2 a fitted point
    is off its own fit by what noise, not the engine, makes (two points per piece fit almost exactly)."""
    over = [w for w in held.worst if w[-1] > tol]
    return over + [w for w in own.worst if w[-1] > tol / 2] if over else []


STALLED = 0.02  # a re-timed point whose time moved less than this over a round: its runs found no noise


@dataclass(frozen=True)
class Round:
    """One re-measure: what failed before it, and how many points it re-timed."""

    failing: dict[str, float]    # quantity -> the largest error of the points that sent it back
    points: dict[str, int]       # quantity -> points re-timed

    def to_json(self) -> dict:
        return {"worst_error_before": {q: round(e, 4) for q, e in self.failing.items()}, "points": self.points}


async def settle(series: dict[str, Series], judge: Callable[[dict[str, Series]], tuple[object, dict[str, list]]],
                 rounds: int, note: Callable[[str, int], None] = lambda message, runs: None,
                 tick: Callable[[], None] = lambda: None):
    """Judge the points as timed; while a quantity fails its held-out check, re-time its failing held-out
    points and their fitted neighbours (the series' ``reps`` runs each) and judge again, at most
    ``rounds`` times. ``note(message, runs)`` announces each round and the runs it will take.

    A round after which no re-timed point's time moved by more than ``STALLED`` found no noise to outrun
    (the engine's cost is what the model misses), and the next would find none either: it is the last.

    ``judge(series)`` -> (verdict, doubted): doubted maps a quantity that failed to the samples to re-time
    with their error ((x..., seconds, model, rel) rows, as ``checks.HeldOut.worst``): held-out ones (with
    their fitted neighbours) and fitted ones (alone). Returns (the last verdict, the rounds taken)."""
    done: list[Round] = []
    moved = True
    while True:
        verdict, failing = judge(series)
        failing = {q: rows for q, rows in failing.items() if rows and q in series}
        if not failing or len(done) == rounds or not moved:
            return verdict, done
        todo = {q: series[q].around([r[:-2] for r in rows]) for q, rows in failing.items()}
        worst = {q: max(r[-1] for r in rows) for q, rows in failing.items()}
        note(f"profile: re-timing {sum(map(len, todo.values()))} points (round {len(done) + 1} of {rounds}): "
             + "; ".join(f"{q} off by up to {worst[q]:.1%}, {len(todo[q])} points" for q in todo),
             sum(len(idx) * series[q].reps for q, idx in todo.items()))
        before = {(q, i): series[q].time_of(i) for q, idx in todo.items() for i in idx}
        for q, idx in todo.items():
            await time_points(series[q], idx, series[q].reps, tick)
        moved = any(abs(series[q].time_of(i) - t) > STALLED * t for (q, i), t in before.items())
        done.append(Round(worst, {q: len(v) for q, v in todo.items()}))
