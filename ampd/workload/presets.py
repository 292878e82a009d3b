"""Synthetic workloads whose means reproduce Table 1 of the AMPD paper.

The paper replays recorded traces (ToolBench, GAIA/TRAIL, and its own HotpotQA and DuReader RAG
runs) that we do not ship; these presets draw sessions whose per-round means match Table 1. Every
distribution and tool-latency choice here is ours; docs/workload.md lists them and says why.

Reading of Table 1: "avg prefill length" is the mean number of *new* input tokens per round (the
initial prompt for round 0, a tool result for later rounds), pooled over all rounds of all sessions;
"avg decode length" likewise per round; "avg #rounds" is per session.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .trace import Session, sessions_from_columns

__all__ = ["Lengths", "ToolKind", "Preset", "PRESETS", "generate", "MAX_SESSIONS"]

MAX_SESSIONS = 5_000_000


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True, slots=True)
class Lengths:
    """A lognormal with the given *mean* (after clipping to [lo, hi]) and log-space ``sigma``."""

    mean: float
    sigma: float
    lo: float
    hi: float

    def clipped_mean(self, mu: float) -> float:
        """E[clip(X, lo, hi)] for X = exp(N(mu, sigma^2))."""
        s = self.sigma
        a = (math.log(self.lo) - mu) / s
        b = (math.log(self.hi) - mu) / s
        inner = math.exp(mu + s * s / 2) * (_phi(b - s) - _phi(a - s))
        return self.lo * _phi(a) + self.hi * (1 - _phi(b)) + inner

    def mu(self) -> float:
        """Log-space location such that the clipped mean equals ``mean`` (bisection)."""
        if not (self.lo < self.mean < self.hi) or self.sigma <= 0:
            raise ValueError(f"bad lengths {self}")
        lo, hi = math.log(self.lo) - 10 * self.sigma, math.log(self.hi) + 10 * self.sigma
        for _ in range(200):
            mid = (lo + hi) / 2
            if self.clipped_mean(mid) < self.mean:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def transform(self, z: np.ndarray) -> np.ndarray:
        """Map standard normal draws to clipped lognormal values (floats)."""
        return _clipped_lognormal(z, self.mu(), self.sigma, self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class ToolKind:
    """One kind of tool/environment call with its share of calls and latency (seconds)."""

    name: str
    share: float
    latency: Lengths


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    description: str
    table1_rounds: float        # Table 1 targets (per session / per round)
    table1_input: float
    table1_output: float
    rounds_shift: int           # rounds = rounds_shift + Binomial(rounds_n, rounds_p)
    rounds_n: int
    first_input: Lengths        # round 0: system prompt, tool schemas / few-shot, question
    output: Lengths             # decode tokens of every round
    tools: tuple[ToolKind, ...]
    later_sigma: float          # tool results (rounds >= 1): lognormal sigma and bounds;
    later_lo: float             # their mean is derived so the per-round mean hits Table 1
    later_hi: float

    @property
    def rounds_p(self) -> float:
        return (self.table1_rounds - self.rounds_shift) / self.rounds_n if self.rounds_n else 0.0

    @property
    def max_rounds(self) -> int:
        return self.rounds_shift + self.rounds_n

    @property
    def later_input(self) -> Lengths:
        r = self.table1_rounds
        mean = (self.table1_input * r - self.first_input.mean) / (r - 1)
        return Lengths(mean, self.later_sigma, self.later_lo, self.later_hi)

    @property
    def mean_tool_s(self) -> float:
        return sum(t.share * t.latency.mean for t in self.tools) / sum(t.share for t in self.tools)

    @property
    def targets(self) -> dict[str, float]:
        return {"mean_rounds": self.table1_rounds, "mean_input_per_round": self.table1_input,
                "mean_output_per_round": self.table1_output}


def _L(mean: float, sigma: float, lo: float, hi: float) -> Lengths:
    return Lengths(float(mean), float(sigma), float(lo), float(hi))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="toolbench",
            description="ToolBench-like tool-use agent: long first prompt with API schemas, "
                        "short function-call decodes, ~1 s REST API calls",
            table1_rounds=3.96, table1_input=703.79, table1_output=50.39,
            rounds_shift=1, rounds_n=8,
            first_input=_L(1500, 0.30, 400, 4000),
            output=_L(50.39, 0.50, 4, 512),
            tools=(ToolKind("api_call", 1.0, _L(1.0, 0.60, 0.05, 15.0)),),
            later_sigma=0.90, later_lo=8, later_hi=4096,
        ),
        Preset(
            name="gaia",
            description="GAIA-like (TRAIL) research agent: many rounds, long web/file "
                        "observations, long reasoning decodes, slow web/browser/code tools",
            table1_rounds=11.32, table1_input=6161.02, table1_output=528.76,
            rounds_shift=2, rounds_n=28,
            first_input=_L(8000, 0.25, 3000, 16000),
            output=_L(528.76, 0.70, 16, 4096),
            tools=(ToolKind("web_search", 0.35, _L(2.5, 0.50, 0.3, 30.0)),
                   ToolKind("visit_page", 0.35, _L(6.0, 0.60, 0.5, 60.0)),
                   ToolKind("python", 0.30, _L(1.5, 0.70, 0.05, 30.0))),
            later_sigma=1.00, later_lo=16, later_hi=32768,
        ),
        Preset(
            name="hotpotqa",
            description="HotpotQA iterative RAG: exactly 3 rounds (3 retrievals: one before "
                        "round 0, one after rounds 0 and 1), Wikipedia passages, ~0.25 s retrieval",
            table1_rounds=3, table1_input=1569.8, table1_output=80.03,
            rounds_shift=3, rounds_n=0,
            first_input=_L(2400, 0.20, 1000, 4500),
            output=_L(80.03, 0.50, 8, 512),
            tools=(ToolKind("retrieve", 1.0, _L(0.25, 0.30, 0.05, 2.0)),),
            later_sigma=0.35, later_lo=200, later_hi=3000,
        ),
        Preset(
            name="dureader",
            description="DuReader iterative RAG: exactly 3 rounds, longer Chinese web passages, "
                        "~0.4 s retrieval",
            table1_rounds=3, table1_input=3081.23, table1_output=150.10,
            rounds_shift=3, rounds_n=0,
            first_input=_L(4200, 0.20, 1800, 8000),
            output=_L(150.10, 0.50, 16, 1024),
            tools=(ToolKind("retrieve", 1.0, _L(0.40, 0.30, 0.08, 3.0)),),
            later_sigma=0.35, later_lo=400, later_hi=6000,
        ),
    )
}


def _arrivals(rng: np.random.Generator, rate: float, duration: float) -> np.ndarray:
    """Poisson arrival times in [0, duration): cumulative Exp(1) gaps divided by rate.

    Gaps are drawn in chunks from one stream, so the result does not depend on chunk sizes and
    the arrivals at rate 2r are exactly those at rate r, halved."""
    horizon = rate * duration                  # in units of mean gaps
    parts: list[np.ndarray] = []
    total = 0.0
    while total < horizon:
        want = int(horizon - total + 4 * math.sqrt(horizon - total + 1) + 16)
        gaps = rng.exponential(1.0, size=want)
        cum = total + np.cumsum(gaps)
        parts.append(cum)
        total = float(cum[-1])
        if sum(len(p) for p in parts) > MAX_SESSIONS + 1000:
            break
    cum = np.concatenate(parts) if parts else np.empty(0)
    return cum[cum < horizon] / rate


def generate(preset: str, rate: float, duration: float, seed: int) -> list[Session]:
    """Sessions of ``preset`` arriving as a Poisson process of ``rate`` sessions/s over
    [0, ``duration``) seconds; deterministic in ``seed``.

    Each random quantity has its own stream, drawn a fixed number of times per session, so
    session i's rounds are the same for any rate and duration (only arrivals move)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 sessions/s, got {rate!r}")
    if not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0):
        raise ValueError(f"duration must be a finite number > 0 seconds, got {duration!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if rate * duration > MAX_SESSIONS:
        raise ValueError(f"rate x duration = {rate * duration:.0f} sessions is over the limit "
                         f"of {MAX_SESSIONS}")
    p = PRESETS[preset]
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(int(seed)).spawn(6)]
    arrival = _arrivals(streams[0], float(rate), float(duration))
    nrounds, inputs, outputs, tool_s = _rounds(p, streams[1:], len(arrival))
    return _sessions(preset, _round6(arrival), nrounds, inputs, outputs, tool_s)


def _round6(x: np.ndarray) -> list[float]:
    """``[round(v, 6) for v in x.tolist()]`` without Python's cost per value (dtoa, a string, strtod).

    Python's round is the double nearest the decimal M/10^6, M the integer nearest x*10^6 (ties to
    even, on x's exact value); for an integer m < 2^53, m / 1e6 is that double too (IEEE division
    rounds the exact quotient). ``y = x * 1e6`` is within a spacing of the exact product, so where y
    is over 4 spacings from a half-integer, rint(y) is M. The rest (near ties, huge or not finite)
    take Python's own round."""
    y = x * 1e6
    a = np.abs(y)
    out = (np.rint(y) / 1e6).tolist()
    with np.errstate(invalid="ignore"):  # inf - inf: not safe, as nan compares
        safe = (np.abs(a - np.floor(a) - 0.5) > 4 * np.spacing(a)) & (a < 2.0 ** 52)
    for i in np.flatnonzero(~safe).tolist():
        out[i] = round(float(x[i]), 6)
    return out


# Every stream draws an (n, max_rounds) block, row i for session i, of which session i uses the first k
# (its rounds): the draws stay the same (the layout is the trace's), but only the used ones, gathered
# in row order (session by session, round by round), are transformed and turned into Python numbers
# (~11 of 30 for GAIA; the rest were 2/3 of the work). Elementwise arithmetic does not depend on where
# an element sits, and neither does np.exp (numpy's is one SIMD kernel lane by lane, masked tails
# included; checked bitwise over offsets, strides and row widths), so each value is the one the full
# block gave. One buffer takes each stream's block in turn (``out=`` draws the same numbers as
# ``size=``), so the 24 MB blocks are not each allocated and page-faulted afresh.

def _rounds(p: Preset, streams: list[np.random.Generator], n: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sessions' round counts (n) and their rounds' inputs, outputs and tool latencies (one entry per
    round, session after session; a session's last round has a latency too, unused)."""
    r_rounds, r_in, r_out, r_kind, r_tool = streams
    if p.rounds_n:
        nrounds = p.rounds_shift + r_rounds.binomial(p.rounds_n, p.rounds_p, size=n)
    else:
        nrounds = np.full(n, p.rounds_shift)
    block = np.empty((n, p.max_rounds))
    flat, used = block.reshape(-1), np.flatnonzero(np.arange(p.max_rounds) < nrounds[:, None])

    def draw(stream: np.random.Generator, normal: bool = True) -> np.ndarray:
        (stream.standard_normal if normal else stream.random)(out=block)
        return flat.take(used)

    z_in = draw(r_in)
    starts = (np.cumsum(nrounds) - nrounds)[nrounds > 0]  # each session's round 0 among the used
    inputs = p.later_input.transform(z_in)
    inputs[starts] = p.first_input.transform(z_in[starts])
    outputs = p.output.transform(draw(r_out))
    lengths = [np.maximum(np.rint(x), 1).astype(np.int64) for x in (inputs, outputs)]
    kind = _tool_kinds(p.tools, draw(r_kind, normal=False))
    return nrounds, lengths[0], lengths[1], _tool_latencies(p.tools, kind, draw(r_tool))


def _tool_kinds(tools: tuple[ToolKind, ...], u: np.ndarray) -> np.ndarray:
    """Each call's tool, by where its uniform draw falls among the cumulative shares: the number of
    edges at or below it (np.searchsorted's side="right", the last tool taking the rest), counted
    by comparisons (cheaper than a binary search for a handful of tools)."""
    shares = np.array([t.share for t in tools], dtype=float)
    edges = np.cumsum(shares / shares.sum())
    kind = np.zeros(len(u), dtype=np.intp)
    for e in edges[:-1].tolist():
        kind += u >= e
    return kind


def _tool_latencies(tools: tuple[ToolKind, ...], kind: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Each call's latency, ``tools[kind].latency.transform(z)`` to 0.1 ms: the tools' parameters
    gathered per call, the same arithmetic (one pass, not one masked pass per tool)."""
    mu, sigma, lo, hi = (np.array(v)[kind] for v in zip(*((t.latency.mu(), t.latency.sigma, t.latency.lo,
                                                           t.latency.hi) for t in tools)))
    return np.round(_clipped_lognormal(z, mu, sigma, lo, hi), 4)


def _clipped_lognormal(z: np.ndarray, mu, sigma, lo, hi) -> np.ndarray:
    """Standard normal draws ``z`` as lognormal values clipped to [lo, hi]; the parameters are
    scalars (one distribution) or arrays beside ``z`` (one per draw)."""
    return np.clip(np.exp(mu + sigma * z), lo, hi)


# The rounds' numbers go to Python CHUNK sessions at a time: a chunk's ints (Python objects, until its
# rounds hold them as C ints where compiled) are freed before the next chunk's are made, whose memory
# they reuse: not 70 MB of fresh pages (page faults) for the 2M of 100k GAIA sessions.
CHUNK = 4096


def _sessions(preset: str, arrivals: list[float], nrounds: np.ndarray, inputs: np.ndarray, outputs: np.ndarray,
              tool_s: np.ndarray) -> list[Session]:
    """The sessions, numbered from 0, of the given arrivals and rounds (``_rounds``'s columns)."""
    ends = np.cumsum(nrounds).tolist()
    sessions: list[Session] = []
    for a in range(0, len(arrivals), CHUNK):
        b = min(len(arrivals), a + CHUNK)
        lo, hi = ends[a - 1] if a else 0, ends[b - 1]
        sessions += sessions_from_columns(preset, a, arrivals[a:b], nrounds[a:b].tolist(), inputs[lo:hi].tolist(),
                                          outputs[lo:hi].tolist(), tool_s[lo:hi].tolist())
    return sessions
