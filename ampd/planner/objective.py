"""The planner's objective on one deployment, and the brute-force enumeration that checks the ILP."""
from __future__ import annotations

from typing import Iterator, Sequence

from .estimates import Estimates
from .space import KINDS, Deployment

__all__ = ["EPS_BALANCE", "EPS_UNUSED", "evaluate", "surrogate", "bottleneck", "phase_taus", "worst_utilisation",
           "enumerate_deployments", "brute_force_top"]

# Tie-breaks, both small against a difference of the worst normalised P95 that matters. Among
# deployments with the same worst P95 (the bottleneck phase fixes it, so many splits tie), prefer
# the one whose phases are all faster (sum of each phase's worst tau: a balanced split beats one
# that starves the other phase), then the one that leaves fewer GPUs idle.
EPS_BALANCE = 1e-3
EPS_UNUSED = 1e-4


def evaluate(dep: Deployment, est: Estimates, gpus: int) -> tuple[float, dict[str, float], dict[str, int], int]:
    """(the ILP's objective, the worst tau of each kind, each kind's level index, the spill index) of
    ``dep`` on ``gpus`` GPUs: the ILP's optimum over the spill share with the replica counts fixed.
    A larger share j lets the decode replicas run up to SPILLS[j] x their prefill capacity of the
    prefills (the prefill workers carry the rest: a lower level), at tau[decode][n][l][j]; a group
    of c prefill replicas of degree n takes tau[prefill][n][l][i] of the largest pool POOLS[i] <= c."""
    unused = EPS_UNUSED * (gpus - dep.gpus) / gpus
    if dep.colocated:
        groups = dep.groups("colocated")
        i = est.level_index("colocated", groups)
        t = max(est.tau["colocated"][n][i] for n, _ in groups)
        return t + EPS_BALANCE * t + unused, {"colocated": t}, {"colocated": i}, 0
    dec = dep.groups("decode")
    ld = est.level_index("decode", dec)
    local = sum(c * est.capacity["prefill"][n] for n, c in dec)
    best = None
    for j, f in enumerate(est.spills):
        lp = est.level_index("prefill", dep.prefill, max(0.0, est.rate - f * local))
        tp = max(est.tau["prefill"][n][lp][est.pool_index(c)] for n, c in dep.prefill)
        td = max(est.tau["decode"][n][ld][j] for n, _ in dec)
        obj = max(tp, td) + EPS_BALANCE * (tp + td) + unused
        if best is None or obj < best[0] - 1e-12:
            best = (obj, {"prefill": tp, "decode": td}, {"prefill": lp, "decode": ld}, j)
    return best


def bottleneck(dep: Deployment, est: Estimates) -> tuple[float, dict[str, int]]:
    """Z: the largest tau over the replicas the deployment instantiates, and the level of each kind."""
    _, taus, lv, _ = evaluate(dep, est, max(dep.gpus, 1))
    return max(taus.values()), lv


def phase_taus(dep: Deployment, est: Estimates) -> dict[str, float]:
    """The worst tau of each kind the deployment instantiates (at its level)."""
    return evaluate(dep, est, max(dep.gpus, 1))[1]


def surrogate(dep: Deployment, est: Estimates, gpus: int) -> float:
    """The ILP's objective value of ``dep`` on ``gpus`` GPUs."""
    return evaluate(dep, est, gpus)[0]


def worst_utilisation(dep: Deployment, est: Estimates) -> float:
    """The highest utilisation rate / capacity over the kinds the deployment instantiates (the
    continuous value the ILP's levels round up)."""
    worst = 0.0
    for kind in KINDS:
        groups = dep.groups(kind)
        if groups:
            cap = sum(c * est.capacity[kind][n] for n, c in groups)
            worst = max(worst, est.rate / cap if cap > 0 else float("inf"))
    return worst


def _vectors(degrees: Sequence[int], budget: int, mixed: bool,
             exact: bool = False) -> Iterator[tuple[dict[int, int], int]]:
    """Every non-empty replica-count vector over ``degrees`` using at most ``budget`` GPUs (exactly
    ``budget`` with ``exact``: the last degree a vector may take fills what is left, or nothing)."""
    degs = list(degrees)

    def rec(i: int, left: int, acc: dict[int, int]):
        if i == len(degs):
            if acc and (not exact or left == 0):
                yield dict(acc), budget - left
            return
        n = degs[i]
        yield from rec(i + 1, left, acc)
        if not mixed and acc:
            return
        if exact and (not mixed or i == len(degs) - 1):
            counts = range(left // n, left // n + 1) if left >= n and left % n == 0 else range(0)
        else:
            counts = range(1, left // n + 1)
        for c in counts:
            acc[n] = c
            yield from rec(i + 1, left - n * c, acc)
        acc.pop(n, None)
    yield from rec(0, budget, {})


def enumerate_deployments(gpus: int, degrees: Sequence[int], *, disaggregated: bool = True,
                          colocated: bool = True, mixed: bool = True, all_gpus: bool = False) -> Iterator[Deployment]:
    """Every deployment of the search space (at least one replica per phase it runs; exactly ``gpus``
    GPUs with ``all_gpus``)."""
    if disaggregated:
        for pre, used in _vectors(degrees, gpus, mixed):
            for dec, _ in _vectors(degrees, gpus - used, mixed, exact=all_gpus):
                yield Deployment.of(pre, dec)
    if colocated:
        for dec, _ in _vectors(degrees, gpus, mixed, exact=all_gpus):
            yield Deployment.of({}, dec)


def brute_force_top(est: Estimates, gpus: int, degrees: Sequence[int], k: int, **space) -> list[tuple[float, Deployment]]:
    """The ``k`` best deployments by :func:`surrogate`, by full enumeration: the tests' reference for
    the ILP (the planner always solves it with SCIP). Equal objectives go to the lower
    :func:`worst_utilisation`: past saturation every deployment whose phases round up to the same
    level ties (one tau per level), and the one whose bottleneck carries the least excess load is the
    better guess (SCIP breaks such ties arbitrarily)."""
    scored = [(surrogate(d, est, gpus), d) for d in enumerate_deployments(gpus, degrees, **space)]
    scored.sort(key=lambda t: (t[0], worst_utilisation(t[1], est), t[1]))
    return scored[:k]
