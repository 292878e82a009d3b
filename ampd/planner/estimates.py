"""Per-replica latency estimates tau(kind, n, level), made with the simulator.

Why levels: a replica's P95 depends on the load it carries, and that load depends on the whole
deployment. The planner assumes the dispatcher spreads each phase's load in proportion to a
capacity weight ``c(n)`` (sessions/s one replica of degree ``n`` sustains; weighted round-robin,
as in the paper's simulator). Then every replica of a phase runs at the same utilisation
``rho = rate / sum_n count(n) c(n)``, and a replica of degree ``n`` carries ``rho * c(n)`` sessions/s.
``tau(kind, n, l)`` is the P95 of one replica simulated alone at the load of level ``rho_l``,
normalised by its SLO threshold (1.0 = the P95 sits exactly on the threshold). The estimates do not
depend on the GPU count or the workload's rate (only on its session mix), so one set serves every
plan for a workload and is cached.
"""
from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from .space import KINDS

__all__ = ["LEVELS", "OVERLOAD", "SIM_MAX_RHO", "saturated", "Estimates", "EstimateCache", "capacities",
           "build_estimates", "sample_sessions", "workload_rate", "latency_p95", "outcome"]

# Utilisation levels rho_l. Those up to SIM_MAX_RHO are simulated; the ones above are past saturation
# in closed form (saturated()); the last (inf) is "overloaded": any capacity satisfies it, at OVERLOAD.
LEVELS = (0.1, 0.25, 0.4, 0.55, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0, 3.0, math.inf)
SIM_MAX_RHO = 1.2
STOP_AT = 20.0        # a normalised P95 at or above this counts as saturated (no level above is simulated)
OVERLOAD = 100.0      # tau of the inf level: above every saturated() value of a finite level


def saturated(rho: float) -> float:
    """tau of a replica that does not keep up at utilisation ``rho``: STOP_AT x (1 + rho). Above
    every unsaturated tau and growing with the load, so past saturation the ILP still ranks
    deployments: it minimises the worst phase's excess load (a balanced split beats a lopsided one)
    instead of seeing one flat "overload" everywhere."""
    return STOP_AT * (1.0 + rho)

SAMPLE_SESSIONS = 96  # sessions drawn from the workload (its mix, evenly drawn)
STEADY_FACTOR = 2.5   # an estimate simulation runs this many session lifetimes' worth of arrivals ...
MAX_SIM_SESSIONS = 400  # ... up to this many sessions (the sample repeated), so a big replica fills up
AMPLE_RHO = 0.3       # the phase not being estimated runs at this utilisation (it must not be the bottleneck)
MAX_AMPLE_REPLICAS = 32
DECODE_BATCH_CAP = 256  # largest decode batch the compute-limit weight assumes


@dataclass(frozen=True)
class Estimates:
    """What the ILP needs. ``tau[kind][n][l]``: normalised P95 at level ``levels[l]``;
    ``p95_s[kind][n][l]``: the (TTFT, mean ITL) P95 seconds behind it; ``capacity[kind][n]``: c(n)."""

    rate: float
    levels: tuple[float, ...]
    capacity: Mapping[str, Mapping[int, float]]
    tau: Mapping[str, Mapping[int, tuple[float, ...]]]
    p95_s: Mapping[str, Mapping[int, tuple[tuple[float, float], ...]]] = field(default_factory=dict)

    def degrees(self, kind: str) -> tuple[int, ...]:
        return tuple(sorted(self.tau.get(kind, {})))

    def level_index(self, kind: str, groups) -> int:
        """The lowest level whose utilisation bounds the deployment's: rate / rho_l <= capacity."""
        cap = sum(c * self.capacity[kind][n] for n, c in groups)
        for i, rho in enumerate(self.levels):
            if math.isinf(rho) or self.rate / rho <= cap * (1 + 1e-9):
                return i
        return len(self.levels) - 1


class EstimateCache:
    """Estimate results by (profile, workload mix, SLO, kind, degree, level): planning for another GPU
    count or arrival rate of the same workload reuses every simulation."""

    def __init__(self) -> None:
        self._d: dict[tuple, tuple[float, float, float]] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key):
        v = self._d.get(key)
        if v is None:
            self.misses += 1
        else:
            self.hits += 1
        return v

    def put(self, key, value) -> None:
        self._d[key] = value

    def __len__(self) -> int:
        return len(self._d)

    def to_json(self) -> dict:
        return {"version": 1, "entries": [[list(k), list(v)] for k, v in self._d.items()]}

    @staticmethod
    def from_json(doc) -> "EstimateCache":
        """The cache ``to_json`` wrote; ValueError if the document is not one."""
        if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("entries"), list):
            raise ValueError("not an estimate cache (version 1)")
        c = EstimateCache()
        try:
            for k, v in doc["entries"]:
                c._d[tuple(k)] = tuple(float(x) for x in v)
        except (TypeError, ValueError):
            raise ValueError("malformed estimate cache entry") from None
        return c


# ---- the workload -------------------------------------------------------------------------------

def workload_rate(sessions: Sequence) -> float:
    """Session arrival rate (sessions/s) over the trace's arrival span."""
    arr = sorted(s.arrival for s in sessions)
    span = arr[-1] - arr[0]
    if len(arr) < 2 or span <= 0:
        return float(len(arr))  # all at once: treat as one second's worth
    return (len(arr) - 1) / span


def sample_sessions(sessions: Sequence, k: int = SAMPLE_SESSIONS) -> list:
    """``k`` sessions drawn evenly over the trace (by arrival), so the sample keeps its mix."""
    ss = sorted(sessions, key=lambda s: s.arrival)
    if len(ss) <= k:
        return ss
    step = len(ss) / k
    return [ss[int(i * step)] for i in range(k)]


def _fingerprint(sample) -> str:
    h = hashlib.sha1()
    for s in sample:
        h.update(repr([(r.input, r.output, r.tool_s) for r in s.rounds]).encode())
    return h.hexdigest()[:16]


def _lifetime_s(sample, itl_s: float) -> float:
    """Mean seconds a session lives when it decodes at the ITL threshold (tools included)."""
    return statistics.fmean(sum(r.output * itl_s + r.tool_delay_s for r in s.rounds) for s in sample)


def _retimed(sample, rate: float, itl_s: float) -> list:
    """The sample arriving as a Poisson process of ``rate`` sessions/s (fixed unit gaps: deterministic),
    repeated until the arrivals span STEADY_FACTOR session lifetimes (at most MAX_SIM_SESSIONS): with
    fewer, a replica that holds many sessions at once never reaches its steady load."""
    import numpy as np

    want = math.ceil(STEADY_FACTOR * rate * _lifetime_s(sample, itl_s))
    n = max(len(sample), min(MAX_SIM_SESSIONS, want))
    gaps = np.random.default_rng(12345).exponential(1.0, n)
    t = np.cumsum(gaps) - gaps[0]
    return [replace(sample[i % len(sample)], id=f"e{i}", arrival=float(t[i] / rate)) for i in range(n)]


# ---- capacity weights ---------------------------------------------------------------------------

def capacities(profile, sample, degrees, itl_slo_s: float) -> dict[str, dict[int, float]]:
    """c(kind, n): sessions/s one replica of degree ``n`` sustains on this session mix.

    prefill: 1 / mean prefill work of a session (every round, T_pre on its history).
    decode: the smaller of a KV limit (capacity over the KV token-seconds a session holds while it
    decodes at the ITL threshold and waits on tools; Little's law) and a compute limit (tokens/s of
    the largest batch the KV holds, over a session's output tokens). Binding by free KV memory
    shares sessions about in proportion to the KV limit.
    colocated: the same replica does both, so the work adds: 1 / (1/prefill + 1/decode)."""
    kv_ts, outs, ctxs = [], [], []
    for s in sample:
        h, occ = 0, 0.0
        for r in s.rounds:
            ctx = h + r.input + r.output / 2
            ctxs.append(ctx)
            occ += ctx * (r.output * itl_slo_s + r.tool_delay_s)
            h += r.input + r.output
        kv_ts.append(occ)
        outs.append(s.output_tokens)
    mean_kv_ts = max(statistics.fmean(kv_ts), 1e-9)
    mean_out = max(statistics.fmean(outs), 1.0)
    mean_ctx = max(statistics.fmean(ctxs), 1.0)
    cap: dict[str, dict[int, float]] = {k: {} for k in KINDS}
    for n in degrees:
        work = []
        for s in sample:
            h, w = 0, 0.0
            for r in s.rounds:
                w += profile.t_pre(n, h, r.input)
                h += r.input + r.output
            work.append(w)
        c_pre = 1.0 / max(statistics.fmean(work), 1e-9)
        kv = profile.kv_capacity_tokens(n)
        # the largest batch the KV holds whose step still meets the ITL threshold
        batch = max(1, min(DECODE_BATCH_CAP, int(kv // mean_ctx)))
        while batch > 1 and profile.t_dec(n, batch, int(batch * mean_ctx)) > itl_slo_s:
            batch = max(1, int(batch * 0.9))
        c_compute = batch / profile.t_dec(n, batch, int(batch * mean_ctx)) / mean_out
        c_dec = min(kv / mean_kv_ts, c_compute)
        cap["prefill"][n] = c_pre
        cap["decode"][n] = c_dec
        cap["colocated"][n] = 1.0 / (1.0 / c_pre + 1.0 / c_dec)
    return cap


# ---- one estimate simulation --------------------------------------------------------------------

def _p95(xs) -> float:
    import numpy as np

    if not xs:
        return 0.0
    return float(np.percentile(np.asarray(xs, dtype=float), 95, method="higher"))


def outcome(res, slo) -> tuple[float, float, float, float]:
    """(SLO attainment, P95 TTFT over rounds, P95 over sessions of the session's mean ITL, finished
    fraction) of a simulation, in one pass over its compact records (no token times: a session's
    mean ITL is its rounds' gap sums over their gap counts, what the live report judges). The
    attainment is ``ampd.bench.report.judge_session``'s, the rule of every report. A session that
    did not finish counts as infinitely late."""
    from ampd.bench.report import judge_session
    from ampd.sim.records import to_compact_session_records

    ttfts, itls, done, attained = [], [], 0, 0
    for s in to_compact_session_records(res):
        v = judge_session(s, slo)
        attained += v.attained
        for r in s.rounds:
            ttfts.append(math.inf if r.first_token is None else r.first_token - r.input_ready)
        if s.completed:
            done += 1
            itls.append(v.mean_itl or 0.0)
        else:
            ttfts.append(math.inf)
            itls.append(math.inf)
    total = max(len(itls), 1)
    return attained / total, _p95(ttfts), _p95(itls), done / total


def latency_p95(res, slo) -> tuple[float, float, float]:
    """(P95 TTFT, P95 mean ITL, finished fraction) of a simulation (see :func:`outcome`)."""
    _, ttft, itl, done = outcome(res, slo)
    return ttft, itl, done


def _ample(cap: Mapping[int, float], rate: float) -> str:
    """A deployment of the other phase that stays at AMPLE_RHO: the degree of largest capacity."""
    n = max(cap, key=lambda d: cap[d])
    k = min(MAX_AMPLE_REPLICAS, max(1, math.ceil(rate / (AMPLE_RHO * cap[n]))))
    return f"tp{n}*{k}"


def _simulate_one(profile, sample, cap, kind: str, n: int, rho: float, slo) -> tuple[float, float, float]:
    from ampd.sim import simulate

    rate = rho * cap[kind][n]
    sessions = _retimed(sample, rate, slo.itl_s)
    if kind == "prefill":
        kw = dict(policy="remote", prefill=f"tp{n}*1", decode=_ample(cap["decode"], rate))
    elif kind == "decode":
        kw = dict(policy="remote", prefill=_ample(cap["prefill"], rate), decode=f"tp{n}*1")
    else:
        kw = dict(policy="colocated", prefill="none", decode=f"tp{n}*1")
    res = simulate(sessions, profile, ttft_slo_s=slo.ttft_s, itl_slo_s=slo.itl_s, seed=0, **kw)
    ttft, itl, done = latency_p95(res, slo)
    if kind == "prefill":
        norm = ttft / slo.ttft_s
    elif kind == "decode":
        norm = itl / slo.itl_s
    else:
        norm = max(ttft / slo.ttft_s, itl / slo.itl_s)
    if done < 1.0 or not math.isfinite(norm):
        norm = OVERLOAD
    return min(norm, OVERLOAD), ttft, itl


def build_estimates(profile, sessions: Sequence, degrees: Sequence[int], slo, *,
                    kinds: Sequence[str] = KINDS, levels: Sequence[float] = LEVELS,
                    cache: EstimateCache | None = None, sample_size: int = SAMPLE_SESSIONS,
                    progress: Callable[[int, int], None] | None = None) -> Estimates:
    """Estimate tau for every kind, degree and level (simulating each level once, cached)."""
    if not levels or not math.isinf(levels[-1]):
        raise ValueError("levels: the last level must be inf (the overload level)")
    sample = sample_sessions(sessions, sample_size)
    cap = capacities(profile, sample, degrees, slo.itl_s)
    key0 = (profile.name, profile.source, _fingerprint(sample), slo.ttft_s, slo.itl_s, MAX_SIM_SESSIONS)
    tau: dict[str, dict[int, tuple[float, ...]]] = {}
    raw: dict[str, dict[int, tuple[tuple[float, float], ...]]] = {}
    sim_levels = [rho for rho in levels if rho <= SIM_MAX_RHO]
    total = len(kinds) * len(degrees) * len(sim_levels)
    done = 0
    for kind in kinds:
        tau[kind], raw[kind] = {}, {}
        for n in degrees:
            vals, secs, prev, sat = [], [], 0.0, False
            for rho in levels:
                if math.isinf(rho):
                    vals.append(OVERLOAD)
                    secs.append((math.inf, math.inf))
                    continue
                if sat or rho > SIM_MAX_RHO:  # past saturation: closed form, monotone in load
                    vals.append(max(prev, saturated(rho)))
                    secs.append(secs[-1] if sat and secs else (math.inf, math.inf))
                    prev = vals[-1]
                    if rho <= SIM_MAX_RHO:
                        done += 1
                        if progress is not None:
                            progress(done, total)
                    continue
                key = key0 + (kind, n, rho, len(sample))
                hit = cache.get(key) if cache is not None else None
                if hit is None:
                    hit = _simulate_one(profile, sample, cap, kind, n, rho, slo)
                    if cache is not None:
                        cache.put(key, hit)
                norm, ttft, itl = hit
                if norm >= STOP_AT:  # saturated (or unfinished sessions): no heavier level is simulated
                    sat, norm = True, saturated(rho)
                prev = max(prev, norm)  # cumulative max: simulation noise must not make load help
                vals.append(prev)
                secs.append((ttft, itl))
                done += 1
                if progress is not None:
                    progress(done, total)
            tau[kind][n] = tuple(vals)
            raw[kind][n] = tuple(secs)
    return Estimates(rate=workload_rate(sessions), levels=tuple(levels), capacity=cap, tau=tau, p95_s=raw)
