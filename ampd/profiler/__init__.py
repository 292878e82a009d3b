"""The profiler: time an engine through the Engine protocol, fit the piecewise alpha-beta model, judge
the fit on held-out points.

    ampd profile --engine torch --out smollm2.json
    ampd profile --engine mock --profile qwen3-32b@h20 --tp 4,8 --out my.json

Any engine ``ampd.engine.make_engine`` returns can be profiled (``torch``, ``sglang`` where it is
installed; ``mock``, timed by ``--profile``). Per TP degree it times, through the engine's own
``prefill`` and ``decode_step`` on a pool the engine cuts (``make_pool``) as a worker's:

- prefill over (l_hist, l_incr), each on top of a history the engine itself prefilled first;
- decode steps over (batch, context per sequence); an engine that decodes a round as one request of its
  own (``streams_rounds``: SGLang) in rounds that streaming prefills opened, as a decode worker's;
- KV transfer over sizes through the real NIXL path (two ``NixlTransport`` agents, a READ of the
  segments, then the engine's ``pace_transfer``), as a prefill worker reads history KV.

Each point is the minimum over its ``reps`` runs (noise on a shared machine only adds time), timed in
passes over the points in a shuffled order, and points a held-out check doubts are re-timed a bounded
number of times before the profile is judged (``ampd.profiler.measure``). Every prefill gets new token ids (no prefix-cache
hit); an engine that keeps a round's KV resident is timed at a round's steady state (the step after
an untimed first one). The engine computes with the threads the process was given (recorded, never
changed): a profile holds for workers that compute with as many. A computing engine is fitted with
continuous, non-decreasing pieces for relative error (``ampd.perf.fit``); ``merge_runs`` averages
runs taken before and after a comparison, to cancel a machine's drift. Held-out points (``ampd.profiler.checks``) are
timed the same way but never fitted; their error is the profile's ``held_out_error``, and a profile
whose error or shape fails the checks is refused (``ProfileRun.problems``).
"""
from __future__ import annotations

import asyncio
import math
import os
import platform
import selectors
import statistics
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from ampd.config import ProfilerSettings, WorkerSettings
from ampd.perf.fit import fit_decode, fit_kv, fit_prefill
from ampd.perf.profile import LINK_RULES, KVTransfer, Profile, TPModel
from ampd.profiler.checks import HeldOut, error_problems, geo_midpoints, held_out, plan_points, shape_problems
from ampd.profiler.measure import Rotation, Series, Timed, doubted, settle, time_points

__all__ = ["Grid", "GRIDS", "EngineSetup", "FitContext", "ProfileRun", "Timed", "compute_threads", "merge_runs",
           "profile_engine", "wakeup_latency"]


def _powers(lo: int, hi: int) -> tuple[int, ...]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return tuple(out)


@dataclass(frozen=True)
class Grid:
    l_incr: tuple[int, ...]
    l_hist: tuple[int, ...]
    batch: tuple[int, ...]
    context: tuple[int, ...]   # tokens per sequence in a decode batch
    kv_tokens: tuple[int, ...]
    reps: int = 3


# Grids by size, per scale: "gpu" for engines timed at GPU speed (the mock, SGLang on a GPU), "cpu" for
# a model computing on this machine's cores (the torch engine, SGLang on a CPU). Every piece of the
# fit holds two measured x values (ampd.perf.fit.breakpoints_for); the powers of two place a knee
# between two of them. "tiny" is for tests and `make test-sglang` (seconds); "small" a first look;
# "full" what a profile to plan or simulate with is measured on.
GRIDS: dict[str, dict[str, Grid]] = {
    "gpu": {
        "tiny": Grid(l_incr=(1, 8, 64, 256), l_hist=(0, 2048), batch=(1, 4, 16, 64), context=(512, 4096),
                     kv_tokens=(512, 2048, 8192), reps=3),
        "small": Grid(l_incr=(1, 4, 16, 64, 256, 1024), l_hist=(0, 2048), batch=(1, 4, 16, 64),
                      context=(512, 4096), kv_tokens=(64, 1024, 8192), reps=2),
        "full": Grid(l_incr=_powers(1, 4096), l_hist=(0, 1024, 8192), batch=_powers(1, 256),
                     context=(256, 2048, 8192), kv_tokens=_powers(16, 16384), reps=3),
    },
    "cpu": {
        "tiny": Grid(l_incr=(1, 4, 16, 64), l_hist=(0, 128), batch=(1, 2, 4), context=(32, 128),
                     kv_tokens=(16, 64, 256), reps=2),
        "small": Grid(l_incr=(1, 4, 16, 64, 256), l_hist=(0, 512), batch=(1, 2, 4, 8), context=(128, 512),
                      kv_tokens=(16, 256, 4096), reps=3),
        "full": Grid(l_incr=_powers(1, 512), l_hist=(0, 512, 1024), batch=(1, 2, 4, 8, 16), context=(128, 640),
                     kv_tokens=_powers(16, 4096), reps=3),
    },
}


@dataclass(frozen=True)
class EngineSetup:
    """What the profiler needs from an engine backend."""

    engine: str
    model: str
    hardware: str
    tps: tuple[int, ...]
    make: Callable[[int], object]          # TP degree -> an ampd.engine Engine (called once per degree)
    kv_bytes_per_token: int                # the model's KV bytes per token (t_kv's bytes per link)
    kv_capacity_tokens: dict[int, int]
    scale: str = "cpu"                     # which GRIDS suit it
    pool_bytes_per_token: int = 0          # bytes a pool keeps per token when the engine cuts none (mock)
    kv_links: str = "min_tp"
    link: str = ""
    source: str = ""
    prefill_chunk_tokens: dict[int, int] = field(default_factory=dict)  # default: from the fitted prefill
    sleeps: bool = False                   # the engine's time is a timed sleep: subtract the wake-up latency


def _mock_setup(profile_name: str | None, tps, model: str, kv_pool_mb: int) -> EngineSetup:
    from ampd.engine.mock import MockEngine
    from ampd.perf.profile import load_profile

    del model, kv_pool_mb  # the mock's sizes are the profile's
    if not profile_name:
        raise ValueError("profile: the mock engine is timed by a profile; give --profile NAME|FILE")
    src = load_profile(profile_name)
    use = tps or src.tps
    bad = [t for t in use if t not in src.tps]
    if bad:
        raise ValueError(f"tp: {bad} not in profile {src.name} (it covers {list(src.tps)})")
    return EngineSetup(
        engine="mock", model=src.model, hardware=src.hardware, tps=tuple(use), scale="gpu",
        make=lambda tp: MockEngine(src, tp), kv_bytes_per_token=src.kv_bytes_per_token,
        pool_bytes_per_token=64,  # what a live mock worker keeps per token (its timing uses the profile's)
        kv_capacity_tokens={t: src.kv_capacity_tokens(t) for t in use},
        prefill_chunk_tokens={t: src.prefill_chunk_tokens(t) for t in use},
        kv_links=src.kv_transfer.links, link=src.kv_transfer.link, source=src.name, sleeps=True)


def _hardware(engine) -> tuple[str, str]:
    """(hardware name, grid scale) of where ``engine`` computes."""
    try:
        import torch

        if torch.cuda.is_available() and not engine.capabilities.cpu_only:  # the torch engine runs on the CPU
            return torch.cuda.get_device_name(0).lower().replace("nvidia ", "").replace(" ", "-"), "gpu"
    except ImportError:
        pass
    return f"cpu{os.cpu_count()}", "cpu"


def _real_setup(name: str, profile_name: str | None, tps, model: str, kv_pool_mb: int) -> EngineSetup:
    """Any engine ``make_engine`` builds: its KV bytes per token and, from the pool a worker would give
    it (``kv_pool_mb``), its KV capacity."""
    from ampd.engine import check_available, make_engine

    if profile_name:
        raise ValueError(f"profile: only the mock engine is timed by a profile; --engine {name} is measured")
    check_available(name)  # "--engine: ... not installed; install with ..."
    engines: dict[int, object] = {}

    def make(tp: int):
        if tp not in engines:
            try:
                engines[tp] = make_engine(name, None, tp, model)
            except (ValueError, RuntimeError, OSError) as exc:
                raise ValueError(f"model: {exc}") from None
        return engines[tp]
    use = tuple(tps or (1,))
    first = make(use[0])
    bpt = int(first.kv_bytes_per_token)
    cap = max(1, kv_pool_mb * 2**20 // bpt)
    hardware, scale = _hardware(first)
    return EngineSetup(engine=name, model=Path(model).name or model, hardware=hardware, tps=use, make=make,
                       kv_bytes_per_token=bpt, kv_capacity_tokens={t: cap for t in use}, scale=scale,
                       pool_bytes_per_token=bpt,  # an engine that cuts no pool (SGLang) moves the model's bytes
                       kv_links="min_tp", link="NIXL (UCX) between two agents in one process",
                       source=f"{name} engine, model {model}")


def _setup_of(engine: str) -> Callable[..., EngineSetup]:
    """factory(profile name or None, TP degrees or None, model, kv_pool_mb) of a registered engine
    (ampd.engine): one timed by a profile (the mock) takes its times from it, any other is measured."""
    from ampd.engine import ENGINES, capabilities_of

    if engine not in ENGINES:
        raise ValueError(f"engine: {engine!r} cannot be profiled (available: {', '.join(ENGINES)})")
    if capabilities_of(engine).timed_by_profile:
        return _mock_setup
    return lambda *a: _real_setup(engine, *a)


# ---- measuring ----------------------------------------------------------------------------------

class _Region:
    """A pool and its positions: a contiguous run of blocks per use."""

    def __init__(self, setup: EngineSetup, engine, tokens: int, block_tokens: int) -> None:
        from ampd.kv import KVPool

        self.bt = block_tokens
        if engine.capabilities.cuts_pool:
            self.pool = engine.make_pool(tokens, block_tokens)
        else:
            self.pool = KVPool(max(1, math.ceil(tokens / block_tokens)), block_tokens, setup.pool_bytes_per_token)

    def segments(self, start: int, tokens: int):
        from ampd.kv import Segment

        segs, pos, end = [], start, start + tokens
        while pos < end:
            b, off = divmod(pos, self.bt)
            n = min(self.bt - off, end - pos)
            segs.append(Segment(b, off, n))
            pos += n
        return segs


def _ids(engine, n: int, start: int = 0) -> list[int]:
    from ampd.workload import filler_ids

    return filler_ids(n, start, vocab=int(engine.vocab_size))


async def wakeup_latency(reps: int = 20, sleep_s: float = 0.002) -> float:
    """How much later than asked a timed sleep returns on this loop (min over ``reps``): for an engine
    whose time is a sleep (mock), this is the harness's, not the engine's, and is subtracted."""
    from ampd.engine.mock import sleep_until

    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        await sleep_until(time.monotonic() + sleep_s)
        best = min(best, time.perf_counter() - t0 - sleep_s)
    return max(best, 0.0)


async def _prefill_series(setup, engine, points, n_fit, bt) -> Series:
    """Points (l_hist, l_incr), samples (l_hist, l_incr, s). Each history is prefilled by the engine first (untimed), so an engine with a
    cache of its own (SGLang) holds it as after a real earlier round; new KV goes after the history."""
    if not points:
        return Series([], 0, [])
    reg = _Region(setup, engine, max(lh + li for lh, li in points), bt)
    for lh in sorted({lh for lh, _ in points}):
        if lh:
            await engine.prefill(f"profile-h{lh}", 0, lh, reg.pool, reg.segments(0, lh), token_ids=_ids(engine, lh))

    fresh = [1 << 20]  # where the next call's new tokens start in the filler sequence

    def call(lh, li):
        hist, new = reg.segments(0, lh), reg.segments(lh, li)

        def one():
            # new ids at every call: an engine with a prefix cache (SGLang) must compute them each time,
            # as for a real round, rather than find the previous pass's tokens cached
            fresh[0] += li
            return engine.prefill(f"profile-h{lh}", lh, li, reg.pool, new, token_ids=_ids(engine, li, fresh[0]),
                                  history_kv=hist)
        return one
    return Series(list(points), n_fit, [call(lh, li) for lh, li in points])


async def _decode_series(setup, engine, points, n_fit, bt) -> tuple[Series, Callable[[], None]]:
    """Points (batch, context per sequence), samples (batch, context tokens in the batch, s), and what
    ends the sequences once the timing is over. The sequences of a step share one history region (the
    engine gathers each one's rows all the same) and write their new tokens to slots of their own.

    An engine that keeps a decoding round's KV resident (``keeps_round_kv``: the torch engine reads a
    round's history from the pool at its first step only) is timed as a round's steady state: each
    timed step follows an untimed first step of the same sequences, after ``forget`` (the first step
    of a round is the decode worker's, once per round, not per token)."""
    from ampd.engine.base import DecodeSeq

    if not points:
        return Series([], 0, []), lambda: None
    if engine.capabilities.streams_rounds:
        return await _streamed_decode_series(setup, engine, points, n_fit, bt), lambda: None
    top = max(c for _, c in points)
    base = math.ceil(top / bt) * bt
    reg = _Region(setup, engine, base + 2 * max(b for b, _ in points), bt)
    own_kv = engine.capabilities.needs_token_ids  # it attends to its own cache: fill it
    rounds = engine.capabilities.keeps_round_kv
    steps_of: dict[tuple[int, int], tuple[list, list]] = {}
    prefilled: set[str] = set()
    for b, c in points:
        ids = _ids(engine, c + 1)
        first, second = [], []
        for i in range(b):
            sid = f"profile-d{b}x{c}-{i}" if rounds else f"profile-d{c}-{i}"
            if own_kv and sid not in prefilled:
                prefilled.add(sid)
                await engine.prefill(sid, 0, c - 1, reg.pool, reg.segments(0, c - 1), token_ids=ids[:c - 1])
            hist = reg.segments(0, c - 1)
            mine = reg.segments(base + 2 * i, 1)
            first.append(DecodeSeq(sid, c - 1, ids[c - 1], mine, c, history_kv=hist, token_ids=ids[:c]))
            second.append(DecodeSeq(sid, c, ids[c], reg.segments(base + 2 * i + 1, 1), c + 1,
                                    history_kv=hist + mine, token_ids=ids[:c + 1]))
        steps_of[(b, c)] = (first, second)
    await engine.decode_step(reg.pool, steps_of[points[0]][0])  # warm-up: first-step allocations

    def call(b, c):
        first, second = steps_of[(b, c)]
        if not rounds:
            return lambda: engine.decode_step(reg.pool, first)

        async def one():
            for s in first:
                engine.forget(s.session_id)
            await engine.decode_step(reg.pool, first)
            t0 = time.perf_counter()
            await engine.decode_step(reg.pool, second)
            return Timed(time.perf_counter() - t0)
        return one

    def end() -> None:
        for b, c in points if rounds else ():
            for s in steps_of[(b, c)][0]:
                engine.forget(s.session_id)
    # the timed step of a round engine is at context c + 1 per sequence
    return Series(list(points), n_fit, [call(b, c) for b, c in points],
                  lambda key, t: (key[0], key[0] * (key[1] + 1 if rounds else key[1]), t)), end


STREAMED_STEPS = 4  # timed steps per round of an engine that streams rounds


async def _streamed_decode_series(setup, engine, points, n_fit, bt) -> Series:
    """Points (batch, context per sequence), samples (batch, context tokens in the batch, s) of an engine that decodes a round as one request of its
    own and batches the rounds itself (``streams_rounds``: SGLang). Its ``decode_step`` hands out the
    next token of rounds a streaming prefill opened, so each timed pass opens ``batch`` rounds on a
    context, as a decode worker's local prefills do: they start together (a prefill with the round's
    ``RoundStops``), one step is taken untimed (every round is then in the engine's running batch), and
    the mean of the next ``STREAMED_STEPS`` steps is the point's time. The rounds end by their own
    ``max_tokens``. The context is the same ids at every pass, so after the first pass the engine's
    prefix cache makes the reopening cheap; the step is timed at the mean context it read."""
    from ampd.engine.base import DecodeSeq, RoundStops

    steps = STREAMED_STEPS
    stops = RoundStops(max_tokens=steps + 2)  # the prefill's token, the untimed step, the timed ones
    reg = _Region(setup, engine, bt, bt)  # the engine keeps the KV: the pool is the protocol's only

    def call(b, c):
        ids = _ids(engine, c)
        sids = [f"profile-s{b}x{c}-{i}" for i in range(b)]

        async def one():
            firsts = await asyncio.gather(*(engine.prefill(s, 0, c, reg.pool, (), token_ids=ids, stops=stops)
                                            for s in sids))
            ctx = [[*ids, t] for t in firsts]

            async def step():
                toks = await engine.decode_step(reg.pool, [
                    DecodeSeq(s, len(x) - 1, x[-1], [], len(x), token_ids=x) for s, x in zip(sids, ctx)])
                for x, t in zip(ctx, toks):
                    x.append(t)
            try:
                await step()
                t0 = time.perf_counter()
                for _ in range(steps):
                    await step()
                return Timed((time.perf_counter() - t0) / steps)
            finally:
                for s in sids:
                    engine.forget(s)
        return one
    await call(*points[0])()  # warm-up: the engine's first requests and a first batch
    # the timed steps read c + 2 ... c + 1 + steps tokens per sequence. The median of the runs, not the
    # fastest: SGLang's scheduler decodes on in its own process while this one waits for the cores, so a
    # run whose clock starts late finds tokens already made and reads too short (at load 5-10, kept as
    # the fastest, such runs fitted a 1.9 ms step at batch 3, measured at 101 ms).
    return Series(list(points), n_fit, [call(b, c) for b, c in points],
                  lambda key, t: (key[0], key[0] * (key[1] + 1) + key[0] * (steps + 1) // 2, t), stat=statistics.median)


async def _kv_series(setup, make, pairs, sizes, n_fit, bt, ends: list) -> Series:
    """Points and samples (src_tp, dst_tp, tokens, s): a READ of ``tokens`` tokens over NIXL, paced by the
    reading engine. The first ``n_fit`` sizes are fitted, the rest held out. Closing the two agents is
    appended to ``ends``.

    Each run reads the next place of pools a worker's size (the KV capacity), not the same blocks again:
    a worker reads history KV a prefill wrote long before, out of the CPU's caches. Read in place, the
    bytes a run moves are still cached from the run before, and only below the cache's size: on this
    project's CPU (32 MiB L3) 128 tokens of SmolLM2 (5.9 MB) took 0.34 ms read in place, 27 % under
    the line through 64 and 256 tokens, so the held-out check refused KV. Rotating over 256 MiB the
    read took 3.3-3.5 us per token from 64 to 1024 tokens: a line, as the model has it."""
    from ampd.kv.transport import NixlTransport

    engine = make(pairs[0][1])
    span = max(max(sizes), min(setup.kv_capacity_tokens.values()))
    src_reg = _Region(setup, engine, span, bt)
    a = NixlTransport("profile-src", src_reg.pool)
    ends.append(a.close)
    dst = _Region(setup, engine, span, bt)
    b = NixlTransport("profile-dst", dst.pool)
    ends.append(b.close)
    b.add_peer("profile-src", a.metadata(), a.layout)
    place = Rotation(span, bt)

    def call(src, d, n):
        eng = make(d)  # the reading side paces, as a prefill worker does

        async def one():
            at = place.take(n)
            started = time.monotonic()
            await b.read("profile-src", src_reg.segments(at, n), dst.segments(at, n))
            await eng.pace_transfer(started, n, src, d)
        return one
    points = [(src, d, n) for src, d in pairs for n in sizes[:n_fit]] + \
        [(src, d, n) for src, d in pairs for n in sizes[n_fit:]]
    await call(*points[0])()  # warm-up: the first READ connects the agents
    return Series(points, len(pairs) * n_fit, [call(*p) for p in points])


# ---- the run ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FitContext:
    """What fitting measured samples into a Profile needs besides the samples (kept with a run, so runs
    of one engine can be merged and refitted: ``merge_runs``)."""

    name: str
    engine: str
    model: str
    hardware: str
    source: str
    kv_bytes_per_token: int
    kv_links: str
    link: str
    kv_capacity_tokens: dict[int, int]
    prefill_chunk_tokens: dict[int, int]
    monotone: bool       # a computing engine: continuous, non-decreasing pieces (ampd.perf.fit)
    max_error: float


@dataclass
class ProfileRun:
    profile: Profile
    held_out: dict[str, HeldOut] = field(default_factory=dict)   # quantity -> error on held-out points
    problems: list[str] = field(default_factory=list)            # why the profile is refused; empty: accepted
    samples: dict[str, list] = field(default_factory=dict)       # quantity -> fitted (x..., seconds)
    held_out_samples: dict[str, list] = field(default_factory=dict)
    seconds: float = 0.0
    document: dict = field(default_factory=dict)
    context: FitContext | None = None


def _fit(ctx: FitContext, samples: dict[str, list], hsamples: dict[str, list]):
    """(Profile, held-out errors, problems, the fit's errors on its own points) of measured samples."""
    tp_models, held, problems, own = {}, {}, [], {}
    tol = ctx.max_error
    for tp in sorted(ctx.kv_capacity_tokens):
        qp, qd = f"tp.{tp}.t_pre", f"tp.{tp}.t_dec"
        ps, ds = samples[qp], samples[qd]
        try:
            P, hist, attn = fit_prefill(ps, monotone=ctx.monotone)
            D, cty = fit_decode(ds, monotone=ctx.monotone)
        except ValueError as exc:
            raise ValueError(f"grid: {exc} (each piece needs two measured values; widen the grid)") from None
        if tp in ctx.prefill_chunk_tokens:
            chunk = ctx.prefill_chunk_tokens[tp]
        else:
            from ampd.perf.derive import Assumptions, chunk_tokens

            chunk = chunk_tokens(P, attn, Assumptions())
        m = TPModel(kv_capacity_tokens=ctx.kv_capacity_tokens[tp], prefill_chunk_tokens=chunk,
                    pre=P, pre_hist_s_per_token=hist, pre_attn_s_per_token2=attn, dec=D, dec_ctx_s_per_token=cty)
        tp_models[tp] = m

        def t_pre(lh, li, m=m):
            return m.pre(li) + m.pre_hist_s_per_token * lh + m.pre_attn_s_per_token2 * li * (lh + li / 2)

        def t_dec(b, c, m=m):
            return m.dec(b) + m.dec_ctx_s_per_token * c
        held[qp], held[qd] = held_out(hsamples[qp], t_pre), held_out(hsamples[qd], t_dec)
        own[qp], own[qd] = held_out(ps, t_pre), held_out(ds, t_dec)
        problems += error_problems(qp, held[qp], ("l_hist", "l_incr"), tol)
        problems += error_problems(qd, held[qd], ("batch", "context_tokens"), tol)
        problems += shape_problems(f"{qp} P(l_incr)", "tokens", P, 1, tol,
                                   [(li, t - t_pre(lh, li) + P(li)) for lh, li, t in ps])
        problems += shape_problems(f"{qd} D(batch)", "sequences", D, 1, tol,
                                   [(b, t - cty * c) for b, c, t in ds])
    rule = LINK_RULES[ctx.kv_links]

    def per_link(s, d, n):
        return n * ctx.kv_bytes_per_token / rule(s, d)
    ks, hks = samples["t_kv"], hsamples["t_kv"]
    try:
        K = fit_kv([(per_link(s, d, n), t) for s, d, n, t in ks], monotone=ctx.monotone)
    except ValueError as exc:
        raise ValueError(f"grid: KV transfer: {exc} (widen the grid's KV sizes)") from None
    held["t_kv"] = held_out(hks, lambda s, d, n: K(per_link(s, d, n)))
    own["t_kv"] = held_out(ks, lambda s, d, n: K(per_link(s, d, n)))
    problems += error_problems("t_kv", held["t_kv"], ("src_tp", "dst_tp", "tokens"), tol)
    problems += shape_problems("t_kv K(bytes per link)", "bytes", K,
                               min(per_link(s, d, 1) for s, d, *_ in ks), tol,
                               [(per_link(s, d, n), t) for s, d, n, t in ks])
    prof = Profile(name=ctx.name, model=ctx.model, hardware=ctx.hardware, kv_bytes_per_token=ctx.kv_bytes_per_token,
                   tp_models=tp_models, kv_transfer=KVTransfer(K, ctx.kv_links, ctx.link),
                   description=f"Measured by `ampd profile --engine {ctx.engine}`"
                               + (f" ({ctx.source})" if ctx.source else "") + "; see docs/planner.md.")
    return prof, held, problems, own


def _document(prof: Profile, ctx: FitContext, held, samples, hsamples, profiling: dict) -> dict:
    doc = prof.to_json()
    doc["profiling"] = {
        "engine": ctx.engine, "source": ctx.source, **profiling,
        "fit": "continuous non-decreasing pieces, relative least squares" if ctx.monotone
               else "independent pieces, least squares",
        "max_held_out_error": ctx.max_error,
        "held_out_error": {k: v.to_json() for k, v in held.items()},
        "samples": {k: [list(x) for x in v] for k, v in samples.items()},
        "held_out_samples": {k: [list(x) for x in v] for k, v in hsamples.items()}}
    return doc


def compute_threads() -> int | None:
    """The intra-op threads the engine computes with in this process (torch's, as OMP_NUM_THREADS or
    torch.set_num_threads left them); None without torch. A profile is only valid for workers that
    compute with as many threads: the profiler records it and does not change it."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


REMEASURE_ROUNDS = 2  # re-measures of the points a held-out check doubts before a profile is judged


async def _run(setup: EngineSetup, grid: Grid, name: str, block_tokens: int, max_error: float,
               progress, note) -> ProfileRun:
    t0 = time.monotonic()
    load_start = os.getloadavg()[0]
    cache: dict[int, object] = {}

    def make(tp: int):
        if tp not in cache:
            cache[tp] = setup.make(tp)
        return cache[tp]
    plans = {}
    for tp in setup.tps:
        ctx_limit = int(make(tp).max_context)
        plans[tp] = plan_points(grid.l_hist, grid.l_incr, grid.batch, grid.context,
                                setup.kv_capacity_tokens[tp], ctx_limit)
    kv_held = geo_midpoints(grid.kv_tokens)
    pairs = [(tp, tp) for tp in setup.tps]
    # a KV read is short next to a prefill: more passes for it cost little and steady its time
    kv_reps = grid.reps if setup.sleeps else 2 * grid.reps
    total = grid.reps * sum(len(p.pre) + len(p.dec) + len(p.hpre) + len(p.hdec) for p in plans.values()) \
        + kv_reps * len(pairs) * (len(grid.kv_tokens) + len(kv_held))
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    def more(message: str, runs: int) -> None:
        nonlocal total
        total += runs
        if note is not None:
            note(message)

    oh = await wakeup_latency() if setup.sleeps else 0.0
    series: dict[str, Series] = {}
    ends: list[Callable[[], None]] = []
    ctx = FitContext(name=name, engine=setup.engine, model=setup.model, hardware=setup.hardware,
                     source=setup.source, kv_bytes_per_token=setup.kv_bytes_per_token, kv_links=setup.kv_links,
                     link=setup.link, kv_capacity_tokens=dict(setup.kv_capacity_tokens),
                     prefill_chunk_tokens=dict(setup.prefill_chunk_tokens), monotone=not setup.sleeps,
                     max_error=max_error)
    try:
        async def timed(q: str, got: Series, reps: int) -> None:
            # Fitted and held-out points are timed together, in the same passes (shuffled: measure.py) on the
            # same pool, so a drift of the machine between two phases cannot show as a held-out error.
            series[q], got.overhead, got.reps = got, oh, reps
            await time_points(got, range(len(got.keys)), reps, tick)
        for tp in setup.tps:
            engine, plan = make(tp), plans[tp]
            await timed(f"tp.{tp}.t_pre", await _prefill_series(setup, engine, plan.pre + plan.hpre, len(plan.pre),
                                                                block_tokens), grid.reps)
            dec, end = await _decode_series(setup, engine, plan.dec + plan.hdec, len(plan.dec), block_tokens)
            ends.append(end)
            await timed(f"tp.{tp}.t_dec", dec, grid.reps)
        await timed("t_kv", await _kv_series(setup, make, pairs, list(grid.kv_tokens) + kv_held,
                                             len(grid.kv_tokens), block_tokens, ends), kv_reps)

        def judge(ser: dict[str, Series]):
            prof, held, problems, own = _fit(ctx, *_split(ser))
            return (prof, held, problems), {q: doubted(e, own[q], max_error) for q, e in held.items()}
        (prof, held, problems), rounds = await settle(series, judge, REMEASURE_ROUNDS, more, tick)
    finally:
        for end in reversed(ends):
            with suppress(Exception):  # ending what the timing opened must not hide why it stopped
                end()
    samples, hsamples = _split(series)
    seconds = time.monotonic() - t0
    doc = _document(prof, ctx, held, samples, hsamples, {
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "compute_threads": compute_threads(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(seconds, 2),
        # timings on a machine shared with other work are only as good as its load let them be
        "loadavg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "wakeup_latency_subtracted_s": oh, "block_tokens": block_tokens, "grid": asdict(grid),
        "samples_are": f"min over {grid.reps} runs" + ("" if kv_reps == grid.reps else f" ({kv_reps} for t_kv)")
                       + (f", more where re-timed ({len(rounds)} round(s))" if rounds else "")
                       + ("; streamed decode steps: median" if _any_median(series) else ""),
        "remeasured": [r.to_json() for r in rounds]})
    return ProfileRun(prof, held, problems, samples, hsamples, seconds, doc, ctx)


def _any_median(series: dict[str, Series]) -> bool:
    """Whether a series keeps the median of its runs (an engine's streamed decode steps)."""
    return any(s.stat is statistics.median for s in series.values())


def _split(series: dict[str, Series]) -> tuple[dict[str, list], dict[str, list]]:
    """(fitted samples, held-out samples) per quantity, at each point's time so far."""
    both = {q: s.samples() for q, s in series.items()}
    return {q: f for q, (f, _) in both.items()}, {q: h for q, (_, h) in both.items()}


def merge_runs(runs: list[ProfileRun], max_error: float | None = None) -> ProfileRun:
    """One profile from several runs of the same engine and grid: each point's time is the mean of the
    runs' times for it, then the fit and its checks are redone. Runs taken before and after what the
    profile is compared with (a live replay) cancel a machine that drifted in between to first order;
    the document lists the runs merged (``merged_from``)."""
    if not runs:
        raise ValueError("runs: nothing to merge")
    ctx = runs[0].context
    if ctx is None or any(r.context is None for r in runs):
        raise ValueError("runs: only runs of this profiler (with their fit context) can be merged")
    if max_error is not None:
        ctx = replace(ctx, max_error=max_error)

    def mean_of(which: str) -> dict[str, list]:
        out = {}
        for q, first in getattr(runs[0], which).items():
            keys = [tuple(x[:-1]) for x in first]
            times = {k: [] for k in keys}
            for r in runs:
                got = {tuple(x[:-1]): x[-1] for x in getattr(r, which).get(q, [])}
                if set(got) != set(keys):
                    raise ValueError(f"runs: {q} was measured at other points in another run (same grid needed)")
                for k in keys:
                    times[k].append(got[k])
            out[q] = [(*k, statistics.fmean(times[k])) for k in keys]
        return out
    samples, hsamples = mean_of("samples"), mean_of("held_out_samples")
    prof, held, problems, _ = _fit(ctx, samples, hsamples)
    first = runs[0].document.get("profiling", {})
    doc = _document(prof, ctx, held, samples, hsamples, {
        **{k: first[k] for k in ("machine", "compute_threads", "block_tokens", "grid", "samples_are") if k in first},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(sum(r.seconds for r in runs), 2),
        "samples_merged": f"mean over {len(runs)} runs of each point's time",
        "merged_from": [{k: r.document.get("profiling", {}).get(k) for k in ("when", "loadavg_1m")}
                        | {"held_out_max": {q: round(e.max_rel, 4) for q, e in r.held_out.items()}}
                        for r in runs]})
    return ProfileRun(prof, held, problems, samples, hsamples, sum(r.seconds for r in runs), doc, ctx)


def profile_engine(engine: str, *, profile: str | None = None, tps: tuple[int, ...] | None = None,
                   grid: Grid | str = "full", reps: int | None = None, name: str | None = None,
                   model: str = "", block_tokens: int = WorkerSettings.block_tokens,
                   kv_pool_mb: int = WorkerSettings.kv_pool_mb, max_error: float = ProfilerSettings.max_held_out_error,
                   progress: Callable[[int, int], None] | None = None,
                   note: Callable[[str], None] | None = None) -> ProfileRun:
    """Profile ``engine`` and fit a :class:`Profile`; ``grid`` is a Grid or a size name of ``GRIDS``.
    ValueError names the bad option (``engine``, ``profile``, ``tp``, ``model``, ``grid``). The run's
    ``problems`` say why the profile must not be used (empty when it passed its checks). ``progress(done,
    total)`` follows the timed runs; ``note`` gets a line at each re-measure round."""
    make_setup = _setup_of(engine)
    if isinstance(grid, str) and grid not in GRIDS["cpu"]:
        raise ValueError(f"grid: {grid!r} is not one of {', '.join(GRIDS['cpu'])}")
    if not model:
        from ampd.config import DeploymentConfig

        model = DeploymentConfig().model
    setup = make_setup(profile, tps, model, kv_pool_mb)
    g = GRIDS[setup.scale][grid] if isinstance(grid, str) else grid
    if reps is not None:
        g = replace(g, reps=reps)
    # select(2) takes its timeout in microseconds; asyncio's default epoll selector rounds every wait
    # up to the next millisecond, which would add up to 1 ms to each timed sleep of the mock engine.
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        return loop.run_until_complete(_run(setup, g, name or f"{setup.model}@{setup.hardware}-{engine}",
                                            block_tokens, max_error, progress, note))
    finally:
        loop.close()
