"""The profiler: time an engine over grids, fit the piecewise alpha-beta model, report the fit error.

    ampd profile --engine mock --profile qwen3-32b@h20 --tp 4,8 --out my.json

Measures, per TP degree, prefill over a grid of (l_hist, l_incr) and decode steps over batch sizes and
per-sequence contexts, through the engine's own ``prefill``/``decode_step`` on a real KV pool; and KV
transfer over sizes through the real NIXL path (two ``NixlTransport`` agents, a READ of the segments,
then the engine's ``pace_transfer``, exactly as a prefill worker reads history KV). Each sample is the
minimum over ``reps`` runs (timer and scheduling noise only ever add time). Fitting is
``ampd.perf.fit``; the fit error of every function, on the fitted points and on held-out midpoints,
is printed and stored in the profile's ``"profiling"`` block.

Engines come from ``ENGINES``: a factory per name returning an :class:`EngineSetup`. ``mock`` is timed
by a profile (``--profile``), so profiling it must give that profile back (the round-trip test). A
real engine (``torch``, ``sglang``) plugs in as one more factory: it builds its engine per TP degree
and states the model's KV bytes per token, its KV capacity and chunk size per degree (from the model
config and the memory it measures); nothing else here changes.
"""
from __future__ import annotations

import asyncio
import math
import selectors
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from ampd.perf.fit import FitError, fit_decode, fit_kv, fit_prefill, rel_errors
from ampd.perf.profile import LINK_RULES, KVTransfer, Profile, TPModel

__all__ = ["Grid", "DEFAULT_GRID", "QUICK_GRID", "EngineSetup", "ENGINES", "ProfileRun", "profile_engine"]

BLOCK_TOKENS = 16


def _powers(lo: int, hi: int) -> tuple[int, ...]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return tuple(out)


@dataclass(frozen=True)
class Grid:
    l_incr: tuple[int, ...] = _powers(1, 4096)
    l_hist: tuple[int, ...] = (0, 1024, 8192)
    batch: tuple[int, ...] = _powers(1, 256)
    context: tuple[int, ...] = (256, 2048, 8192)   # tokens per sequence in a decode batch
    kv_tokens: tuple[int, ...] = _powers(16, 16384)
    reps: int = 3
    validate: bool = True                          # also time midpoints the fit never saw


DEFAULT_GRID = Grid()
QUICK_GRID = Grid(l_incr=(1, 4, 16, 64, 256, 1024), l_hist=(0, 2048), batch=(1, 4, 16, 64), context=(512, 4096),
                  kv_tokens=(64, 1024, 8192), reps=2)


@dataclass(frozen=True)
class EngineSetup:
    """What the profiler needs from an engine backend."""

    engine: str
    model: str
    hardware: str
    tps: tuple[int, ...]
    make: Callable[[int], object]          # TP degree -> an ampd.engine Engine
    kv_bytes_per_token: int                # the model's KV bytes per token (t_kv's bytes per link)
    pool_bytes_per_token: int              # bytes per token the engine keeps in its pool
    kv_capacity_tokens: dict[int, int]
    prefill_chunk_tokens: dict[int, int]
    kv_links: str = "min_tp"
    link: str = ""
    source: str = ""
    sleeps: bool = False                   # the engine's time is a timed sleep: subtract the wake-up latency


def _mock_setup(profile_name: str | None, tps: tuple[int, ...] | None) -> EngineSetup:
    from ampd.engine.mock import MockEngine

    from ampd.perf.profile import load_profile

    if not profile_name:
        raise ValueError("profile: the mock engine is timed by a profile; give --profile NAME|FILE")
    src = load_profile(profile_name)
    use = tps or src.tps
    bad = [t for t in use if t not in src.tps]
    if bad:
        raise ValueError(f"tp: {bad} not in profile {src.name} (it covers {list(src.tps)})")
    return EngineSetup(
        engine="mock", model=src.model, hardware=src.hardware, tps=tuple(use),
        make=lambda tp: MockEngine(src, tp), kv_bytes_per_token=src.kv_bytes_per_token,
        pool_bytes_per_token=64,  # what a live mock worker keeps per token (its timing uses the profile's)
        kv_capacity_tokens={t: src.kv_capacity_tokens(t) for t in use},
        prefill_chunk_tokens={t: src.prefill_chunk_tokens(t) for t in use},
        kv_links=src.kv_transfer.links, link=src.kv_transfer.link, source=src.name, sleeps=True)


# name -> factory(profile name or None, TP degrees or None). `torch` and `sglang` register here.
ENGINES: dict[str, Callable[[str | None, tuple[int, ...] | None], EngineSetup]] = {"mock": _mock_setup}


# ---- measuring ----------------------------------------------------------------------------------

def _segments(start: int, tokens: int):
    """Segments for positions [start, start + tokens) of a contiguous pool (block = position // 16)."""
    from ampd.kv import Segment

    segs, pos, end = [], start, start + tokens
    while pos < end:
        b, off = divmod(pos, BLOCK_TOKENS)
        n = min(BLOCK_TOKENS - off, end - pos)
        segs.append(Segment(b, off, n))
        pos += n
    return segs


def _pool(tokens: int, bpt: int):
    from ampd.kv import KVPool

    return KVPool(max(1, math.ceil(tokens / BLOCK_TOKENS)), BLOCK_TOKENS, bpt)


async def _best_each(calls, reps: int, overhead: float, tick) -> list[float]:
    """The minimum time of each call over ``reps`` passes. Passes go over every call in turn, so a burst
    of contention on a shared machine spoils one run of a point, not all of them."""
    best = [math.inf] * len(calls)
    for rep in range(reps):
        for i, fn in enumerate(calls):
            t0 = time.perf_counter()
            await fn()
            best[i] = min(best[i], time.perf_counter() - t0)
            if rep == reps - 1:
                tick()
    return [max(t - overhead, 0.0) for t in best]


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


def _mid(a: int, b: int) -> int:
    return int(round(math.sqrt(a * b)))


def _midpoints(xs) -> list[int]:
    return sorted({_mid(a, b) for a, b in zip(xs, xs[1:]) if _mid(a, b) not in (a, b)})


async def _prefill_samples(engine, points, bpt, reps, tick, overhead=0.0):
    if not points:
        return []
    pool = _pool(max(lh + li for lh, li in points), bpt)

    def call(lh, li):
        segs = _segments(lh, li)
        return lambda: engine.prefill("profile", lh, li, pool, segs)
    times = await _best_each([call(lh, li) for lh, li in points], reps, overhead, tick)
    return [(lh, li, t) for (lh, li), t in zip(points, times)]


async def _decode_samples(engine, points, bpt, reps, tick, overhead=0.0):
    from ampd.engine.base import DecodeSeq

    if not points:
        return []
    pool = _pool(max(b for b, _ in points) * BLOCK_TOKENS, bpt)

    def call(b, ctx):
        seqs = [DecodeSeq(f"s{i}", ctx - 1, 0, _segments(i * BLOCK_TOKENS, 1), ctx) for i in range(b)]
        return lambda: engine.decode_step(pool, seqs)
    times = await _best_each([call(b, ctx) for b, ctx in points], reps, overhead, tick)
    return [(b, b * ctx, t) for (b, ctx), t in zip(points, times)]


async def _kv_samples(setup, pairs, sizes, reps, tick, overhead=0.0):
    """(src_tp, dst_tp, tokens, seconds): a READ of ``tokens`` tokens over NIXL, paced by the engine."""
    from ampd.kv.transport import NixlTransport

    if not sizes:
        return []
    bpt = setup.pool_bytes_per_token
    cap = max(sizes)
    a = NixlTransport("profile-src", _pool(cap, bpt))
    b = NixlTransport("profile-dst", _pool(cap, bpt))
    try:
        b.add_peer("profile-src", a.metadata(), a.layout)

        def call(src, dst, n):
            engine = setup.make(dst)  # the reading side paces, as a prefill worker does
            segs = _segments(0, n)

            async def one():
                started = time.monotonic()
                await b.read("profile-src", segs, segs)
                await engine.pace_transfer(started, n, src, dst)
            return one
        points = [(src, dst, n) for src, dst in pairs for n in sizes]
        times = await _best_each([call(*p) for p in points], reps, overhead, tick)
    finally:
        b.close()
        a.close()
    return [(*p, t) for p, t in zip(points, times)]


# ---- the run ------------------------------------------------------------------------------------

@dataclass
class ProfileRun:
    profile: Profile
    errors: dict[str, dict[str, FitError]] = field(default_factory=dict)
    samples: dict[str, list] = field(default_factory=dict)  # function -> measured (x..., seconds) tuples
    seconds: float = 0.0
    document: dict = field(default_factory=dict)


def _grid_points(setup: EngineSetup, tp: int, grid: Grid):
    pre = [(lh, li) for lh in grid.l_hist for li in grid.l_incr]
    cap = setup.kv_capacity_tokens[tp]
    dec = [(b, c) for c in grid.context for b in grid.batch if b * c <= cap]
    vpre = [(grid.l_hist[len(grid.l_hist) // 2], li) for li in _midpoints(grid.l_incr)] if grid.validate else []
    cmid = grid.context[len(grid.context) // 2]
    vdec = [(b, cmid) for b in _midpoints(grid.batch) if b * cmid <= cap] if grid.validate else []
    return pre, dec, vpre, vdec


async def _run(setup: EngineSetup, grid: Grid, name: str, progress) -> ProfileRun:
    t0 = time.monotonic()
    plan = {tp: _grid_points(setup, tp, grid) for tp in setup.tps}
    kv_sizes = list(grid.kv_tokens)
    kv_val = _midpoints(grid.kv_tokens) if grid.validate else []
    pairs = [(tp, tp) for tp in setup.tps]
    total = sum(sum(len(x) for x in p) for p in plan.values()) + len(pairs) * (len(kv_sizes) + len(kv_val))
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    oh = await wakeup_latency() if setup.sleeps else 0.0
    bpt, reps = setup.pool_bytes_per_token, grid.reps
    tp_models, errors, samples = {}, {}, {}
    for tp in setup.tps:
        engine = setup.make(tp)
        pre, dec, vpre, vdec = plan[tp]
        ps = await _prefill_samples(engine, pre, bpt, reps, tick, oh)
        ds = await _decode_samples(engine, dec, bpt, reps, tick, oh)
        vps = await _prefill_samples(engine, vpre, bpt, reps, tick, oh)
        vds = await _decode_samples(engine, vdec, bpt, reps, tick, oh)
        samples[f"tp.{tp}.t_pre"], samples[f"tp.{tp}.t_dec"] = ps, ds
        P, hist, attn = fit_prefill(ps)
        D, ctx = fit_decode(ds)
        m = TPModel(kv_capacity_tokens=setup.kv_capacity_tokens[tp], prefill_chunk_tokens=setup.prefill_chunk_tokens[tp],
                    pre=P, pre_hist_s_per_token=hist, pre_attn_s_per_token2=attn, dec=D, dec_ctx_s_per_token=ctx)
        tp_models[tp] = m

        def t_pre(lh, li, m=m):
            return m.pre(li) + m.pre_hist_s_per_token * lh + m.pre_attn_s_per_token2 * li * (lh + li / 2)

        def t_dec(b, c, m=m):
            return m.dec(b) + m.dec_ctx_s_per_token * c
        errors[f"tp.{tp}.t_pre"] = {"fit": rel_errors([(t_pre(lh, li), t) for lh, li, t in ps]),
                                    "validation": rel_errors([(t_pre(lh, li), t) for lh, li, t in vps])}
        errors[f"tp.{tp}.t_dec"] = {"fit": rel_errors([(t_dec(b, c), t) for b, c, t in ds]),
                                    "validation": rel_errors([(t_dec(b, c), t) for b, c, t in vds])}
    rule = LINK_RULES[setup.kv_links]

    def per_link(s, d, n):
        return n * setup.kv_bytes_per_token / rule(s, d)
    ks = await _kv_samples(setup, pairs, kv_sizes, reps, tick, oh)
    vks = await _kv_samples(setup, pairs, kv_val, reps, tick, oh)
    samples["t_kv"] = ks
    K = fit_kv([(per_link(s, d, n), t) for s, d, n, t in ks])
    errors["t_kv"] = {"fit": rel_errors([(K(per_link(s, d, n)), t) for s, d, n, t in ks]),
                      "validation": rel_errors([(K(per_link(s, d, n)), t) for s, d, n, t in vks])}
    prof = Profile(name=name, model=setup.model, hardware=setup.hardware, kv_bytes_per_token=setup.kv_bytes_per_token,
                   tp_models=tp_models, kv_transfer=KVTransfer(K, setup.kv_links, setup.link),
                   description=f"Measured by `ampd profile --engine {setup.engine}`"
                               + (f" (timed by {setup.source})" if setup.source else "") + "; see docs/planner.md.")
    seconds = time.monotonic() - t0
    doc = prof.to_json()
    doc["profiling"] = {"engine": setup.engine, "source": setup.source, "seconds": round(seconds, 2),
                        "wakeup_latency_subtracted_s": oh,
                        "grid": asdict(grid), "samples_are": f"min over {grid.reps} runs",
                        "fit_error": {k: {kk: vv.to_json() for kk, vv in v.items()} for k, v in errors.items()},
                        "samples": {k: [list(x) for x in v] for k, v in samples.items()}}
    return ProfileRun(prof, errors, samples, seconds, doc)


def profile_engine(engine: str, *, profile: str | None = None, tps: tuple[int, ...] | None = None,
                   grid: Grid = DEFAULT_GRID, name: str | None = None,
                   progress: Callable[[int, int], None] | None = None) -> ProfileRun:
    """Profile ``engine`` and fit a :class:`Profile`. ValueError names the bad option."""
    try:
        factory = ENGINES[engine]
    except KeyError:
        raise ValueError(f"engine: {engine!r} cannot be profiled in this build (available: "
                         f"{', '.join(ENGINES)})") from None
    setup = factory(profile, tps)
    # select(2) takes its timeout in microseconds; asyncio's default epoll selector rounds every wait
    # up to the next millisecond, which would add up to 1 ms to each timed sleep of the mock engine.
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        return loop.run_until_complete(_run(setup, grid, name or f"{setup.model}@{setup.hardware}-{engine}", progress))
    finally:
        loop.close()
