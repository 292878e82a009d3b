"""Discrete-event simulation of a whole AMPD deployment on a virtual clock.

The simulator runs the same policy cores as the live services (``ampd.policy``: ``bind``,
``make_router``, ``make_queue``) and the same performance model (``ampd.perf.Profile``), and follows
the "Timing semantics" of docs/architecture.md rule for rule; docs/simulator.md explains the model.

Hot-path notes (100k GAIA sessions on 32 GPUs must run in about a minute on one core):
- one heap event per decode *step* of a whole batch, never one per token;
- a session's tokens are not stored: every decode worker keeps the end time of each of its steps in
  one ``array('d')``; a round that joined the batch at step ``lo`` and decoded ``n`` steps has the
  token times ``first_token, step_times[lo], ..., step_times[lo + n - 1]``;
- the context sum of a batch and the windowed ITL sums are maintained incrementally (O(1) per step).
"""
from __future__ import annotations

import gc
import heapq
from bisect import bisect_right
import math
import time as _time
from array import array
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ampd.window import WindowedMean

from .spec import expand_spec, format_spec, parse_spec

__all__ = ["gc_paused", "PathLatency", "SimConfig", "SimRound", "SimSession", "SimResult", "Simulator", "simulate", "policy_shape"]

@contextmanager
def gc_paused():
    """Pause CPython's cyclic garbage collector for a block (restored after).

    A paper-scale run keeps millions of long-lived objects (sessions, rounds, heap entries); every
    generation-2 collection walks all of them, and collections are triggered by allocation counts,
    so their cost grows with the run: 100k GAIA sessions simulate in 79 s with the collector and
    61 s without, and the report builds in 29 s against 12 s (benchmarks/sim_speed.py). Reference
    counting still frees everything that is not in a cycle; cycles wait for the block to end."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# event codes (ints: cheap to compare in the dispatch loop)
_STEP_DONE = 0
_LOCAL_DONE = 1
_REMOTE_DONE = 2
_COMPUTE_DONE = 3
_ROUND_READY = 4
_PIN_EXPIRED = 5
_LOCAL_CHUNK = 6  # one chunk of a chunked local prefill ended
_DISPATCH = 7  # a round reaches the coordinator and is routed (after PathLatency.dispatch_s)
_HANDOFF = 8  # a remote prefill's KV notification reaches the decode worker

# decode-worker states
_IDLE = 0
_STEPPING = 1
_PREFILLING = 2


@dataclass(frozen=True)
class PathLatency:
    """What the live control path adds to a round, in seconds (all 0 by default: the paper's model).

    ``open_s``: a new session from the coordinator accepting it to its first round being routed
    (bind, attach); ``dispatch_s``: a round's input ready at the decode worker to the coordinator
    routing it and the task reaching the chosen queue; ``handoff_s``: a remote prefill's end to the
    decode worker holding its first token (KV-written notification); ``tool_s``: added to every tool
    call (the sidecar RPC); ``prefill_busy_s``: how much longer than modelled (read + compute +
    write-back) each remote prefill holds its prefill worker (timer slack, the KV write and its
    completion poll); unlike the others it adds up along a queue. The workers' predicted queues
    (``busy_until``) do not include it, as live. TTFT still runs from the input being ready."""

    open_s: float = 0.0
    dispatch_s: float = 0.0
    handoff_s: float = 0.0
    tool_s: float = 0.0
    prefill_busy_s: float = 0.0

    FIELDS = ("open", "dispatch", "handoff", "tool", "prefill_busy")

    def __post_init__(self):
        for f in self.FIELDS:
            v = getattr(self, f + "_s")
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"path latency {f!r} must be a number >= 0 seconds, got {v!r}")

    @property
    def zero(self) -> bool:
        return not (self.open_s or self.dispatch_s or self.handoff_s or self.tool_s or self.prefill_busy_s)

    @classmethod
    def parse(cls, text: str) -> "PathLatency":
        """``"dispatch=0.012,handoff=0.002"`` (seconds; unnamed fields stay 0; '' or 'none': all 0)."""
        text = (text or "").strip()
        if text in ("", "none", "0"):
            return cls()
        vals: dict[str, float] = {}
        for part in text.split(","):
            name, sep, num = part.strip().partition("=")
            name = name.strip()
            if not sep or name not in cls.FIELDS:
                raise ValueError(f"path latency {part.strip()!r}: expected NAME=SECONDS with NAME one of "
                                 f"{', '.join(cls.FIELDS)}")
            if name in vals:
                raise ValueError(f"path latency {name!r} given twice")
            try:
                vals[name] = float(num)
            except ValueError:
                raise ValueError(f"path latency {name!r}: {num.strip()!r} is not a number") from None
        return cls(**{k + "_s": v for k, v in vals.items()})

    def format(self) -> str:
        parts = [f"{f}={getattr(self, f + '_s'):g}" for f in self.FIELDS if getattr(self, f + "_s")]
        return ",".join(parts) or "none"


@dataclass
class SimConfig:
    """What to simulate. ``prefill``/``decode`` are SPEC strings or (tp, replicas) groups."""

    profile: Any
    policy: str
    prefill: Any = ()
    decode: Any = "tp1*1"
    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.1
    seed: int = 0
    window_s: float = 10.0
    kv_contention: bool = False
    queue_window: int = 3
    chunked_prefill: bool = False  # local prefills in chunks interleaved with decode steps
    router_options: dict = field(default_factory=dict)
    path: PathLatency = field(default_factory=PathLatency)  # live control-path latencies (default none)


class SimRound:
    """One round as the simulator saw it (compact: token times live in the worker's step log)."""

    __slots__ = ("round", "input_ready", "first_token", "last_token", "n_tokens", "local",
                 "worker", "step_lo", "target")

    def __init__(self, rnd, input_ready, first_token, last_token, n_tokens, local, worker, step_lo, target):
        self.round = rnd
        self.input_ready = input_ready
        self.first_token = first_token
        self.last_token = last_token
        self.n_tokens = n_tokens
        self.local = local
        self.worker = worker  # index of the decode worker (its step log holds the token times)
        self.step_lo = step_lo
        self.target = target  # worker id the prefill ran on

    @property
    def ttft(self) -> float:
        return self.first_token - self.input_ready

    @property
    def itl_count(self) -> int:
        return max(self.n_tokens - 1, 0)

    @property
    def itl_sum(self) -> float:
        return self.last_token - self.first_token if self.n_tokens > 1 else 0.0


class SimSession:
    """Per-session outcome: the rounds it finished and where it was bound."""

    __slots__ = ("session_id", "arrival", "rounds", "decode_worker", "completed", "end")

    def __init__(self, session_id, arrival, decode_worker):
        self.session_id = session_id
        self.arrival = arrival
        self.rounds: list[SimRound] = []
        self.decode_worker = decode_worker
        self.completed = False
        self.end = math.nan


class _Sess:
    __slots__ = ("sid", "rounds", "r", "dw", "l_hist", "l_incr", "out", "ready", "first", "local",
                 "lo", "ctx_join", "pw", "write_s", "target", "rec", "in_tool", "evicted")

    def __init__(self, sid, rounds, rec):
        self.sid = sid
        self.rounds = rounds
        self.r = 0
        self.dw = None
        self.l_hist = 0
        self.l_incr = 0
        self.out = 0
        self.ready = 0.0
        self.first = 0.0
        self.local = False
        self.lo = 0
        self.ctx_join = 0
        self.pw = None
        self.write_s = 0.0
        self.target = ""
        self.rec = rec
        self.in_tool = False
        self.evicted = False


class _StepLog:
    """The decode steps of one worker as runs ("segments") of steps with a fixed batch.

    Segment ``s`` starts at global step index ``lo[s]`` and time ``t0[s]``; its step ``j`` lasts
    ``A[s] + g[s] * j`` (the batch's context grows by ``batch`` tokens a step and ``t_dec`` is
    affine in the context), so step ``j`` ends at ``t0 + (j + 1) * A + g * j * (j + 1) / 2``.
    ``old[s]``: sessions whose previous token came from the step before the segment; ``n[s]``: batch;
    ``prev[s]``: end of the step before the segment (its first gap includes any prefill pause)."""

    __slots__ = ("lo", "t0", "A", "g", "k", "n", "old", "prev")

    def __init__(self):
        self.lo = array("q")
        self.t0 = array("d")
        self.A = array("d")
        self.g = array("d")
        self.k = array("q")
        self.n = array("q")
        self.old = array("q")
        self.prev = array("d")

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


def _steps_done(x: float, A: float, g: float, m: int) -> int:
    """How many steps of a segment (step j lasts A + g*j) have ended within time x of its start."""
    if x <= 0:
        return 0
    if g > 0:
        # (j+1)*A + g*j*(j+1)/2 <= x  <=>  (g/2) q^2 + (A - g/2) q - x <= 0 with q = j + 1
        a2 = 0.5 * g
        b = A - a2
        q = int((-b + math.sqrt(b * b + 4 * a2 * x)) / (2 * a2))
    else:
        q = int(x / A) if A > 0 else m
    if q > m:
        q = m
    # guard rounding on both sides
    while q < m and (q + 1) * A + g * q * (q + 1) * 0.5 <= x:
        q += 1
    while q > 0 and q * A + g * (q - 1) * q * 0.5 > x:
        q -= 1
    return q


class _Decode:
    __slots__ = ("idx", "wid", "tp", "queue", "qpred", "state", "batch_n", "ctx_sum", "pending",
                 "exit_at", "exit_heap", "step_idx", "log", "last_end", "step_new", "step_ft",
                 "seg_t0", "seg_A", "seg_g", "seg_m", "seg_ver", "seg_flushed", "cut",
                 "kv_cap", "kv_used", "live", "kv_wait", "new_wait", "wait_need", "evictable", "win", "nic", "busy_s",
                 "qver", "qlen", "vq_ver", "vq", "vpred", "view", "v_mean", "v_free", "wadds", "m_adds", "m_t0", "m_mean",
                 "chunk", "chunk_step_due", "busy_until")

    def __init__(self, idx, tp, queue, kv_cap, window_s):
        self.idx = idx
        self.wid = f"decode-{idx}"
        self.tp = tp
        self.queue = queue
        self.qpred = 0.0
        self.state = _IDLE
        self.batch_n = 0
        self.ctx_sum = 0
        self.pending: list[_Sess] = []
        self.exit_at: dict[int, list[_Sess]] = {}
        self.step_idx = 0
        self.exit_heap: list[int] = []
        self.log = _StepLog()
        self.seg_t0 = 0.0
        self.seg_A = 0.0
        self.seg_g = 0.0
        self.seg_m = 0
        self.seg_ver = 0
        self.seg_flushed = 0
        self.cut = False
        self.last_end = 0.0
        self.step_new = 0
        self.step_ft = 0.0
        self.kv_cap = kv_cap
        self.kv_used = 0
        self.live = 0
        self.kv_wait: deque = deque()  # next rounds of running sessions waiting for KV
        self.new_wait: deque = deque()  # bound sessions whose first round waits for KV
        self.wait_need = 0  # KV tokens the waiting rounds need
        self.evictable: deque = deque()  # sessions in a tool call whose KV pin expired
        self.win = WindowedMean(window_s)
        self.nic = 0.0
        self.busy_s = 0.0
        self.chunk: list | None = None  # [session, tokens done] of the chunked local prefill
        self.chunk_step_due = False  # a chunk just ended: one decode step comes next
        self.busy_until = 0.0  # predicted end of the local prefill in service (counts as queued work)
        # routing-view cache: ``qver`` counts pushes/pops of ``queue``; the queue snapshot
        # (``vq``, ``vpred``) is rebuilt only when it changed, the view only when a field changed
        self.qver = 0
        self.qlen = 0  # len(queue), kept by the simulator (cheaper than calling __len__)
        self.vq_ver = -1
        self.vq = ()
        self.vpred = 0.0
        self.view = None
        self.v_mean = None
        self.v_free = 0
        # windowed-mean cache: ``wadds`` counts win.add calls; the mean last read (``m_mean``) holds
        # while no sample was added (``m_adds``) and the oldest sample (``m_t0``) has not expired
        self.wadds = 0
        self.m_adds = -1
        self.m_t0 = math.inf
        self.m_mean = None


class _Prefill:
    __slots__ = ("idx", "wid", "tp", "queue", "qpred", "busy", "busy_until", "win", "nic", "kv_cap", "busy_s", "tasks",
                 "qver", "qlen", "vq_ver", "vq", "vpred", "view", "v_mean", "wadds", "m_adds", "m_t0", "m_mean")

    def __init__(self, idx, tp, queue, kv_cap, window_s):
        self.idx = idx
        self.wid = f"prefill-{idx}"
        self.tp = tp
        self.queue = queue
        self.qpred = 0.0
        self.busy = False
        self.busy_until = 0.0  # predicted end of the task in service (its residual counts as queued work)
        self.win = WindowedMean(window_s)
        self.nic = 0.0
        self.kv_cap = kv_cap
        self.busy_s = 0.0
        self.tasks = 0
        self.qver = 0  # pushes/pops of ``queue`` (routing-view cache, as _Decode)
        self.qlen = 0
        self.vq_ver = -1
        self.vq = ()
        self.vpred = 0.0
        self.view = None
        self.v_mean = None
        self.wadds = 0
        self.m_adds = -1
        self.m_t0 = math.inf
        self.m_mean = None


def policy_shape(name: str):
    """``ampd.policy.policy_spec(name)``: router, queues, whether prefill workers exist, KV pin TTL."""
    from ampd.policy import policy_spec

    return policy_spec(name)


def _affine_ctx_coef(prof, tp: int):
    """c such that t_dec(tp, b, x) == t_dec(tp, b, 0) + c * x for the probed b and x, or None."""
    X = 1_000_000
    c = None
    for b in (1, 2, 7, 33, 128, 512):
        t0 = prof.t_dec(tp, b, 0)
        cb = (prof.t_dec(tp, b, X) - t0) / X
        if cb < 0:
            return None
        for x in (1, 977, 65_536, 4_000_000):
            if not math.isclose(prof.t_dec(tp, b, x), t0 + cb * x, rel_tol=1e-9, abs_tol=1e-12):
                return None
        if c is None:
            c = cb
        elif not math.isclose(c, cb, rel_tol=1e-9, abs_tol=1e-15):
            return None
    return c


class SimResult:
    """What a run produced: per-session outcomes plus the step logs that hold the token times."""

    def __init__(self, policy, sessions, step_logs, duration_s, stats, worker_ids):
        self.policy = policy
        self.sessions: list[SimSession] = sessions
        self.step_logs: list[array] = step_logs
        self.duration_s = duration_s
        self.stats: dict = stats
        self.worker_ids = worker_ids

    # at most this many points summarise the gaps inside one run of steps (compact ITL percentiles)
    SERIES_POINTS = 16

    def itl_samples(self):
        """Every token gap of the run as (values, weights) numpy arrays, without one entry per token.

        The first step of a run has one gap shared by the ``old`` sessions (it includes any prefill
        pause); step ``j >= 1`` of a run has the gap ``A + g*j`` shared by the whole batch (a long
        run's arithmetic series is summarised by ``SERIES_POINTS`` evenly spaced points carrying
        equal weight); a round's first gap (first token -> its first step) is its own sample.
        Vectorised with numpy (the same samples as a per-segment loop)."""
        import numpy as np

        P = self.SERIES_POINTS
        vals: list = []
        wts: list = []
        logs = self.step_logs
        for lg in logs:
            if not len(lg.lo):
                continue
            t0 = np.frombuffer(lg.t0, dtype=np.float64)
            A = np.frombuffer(lg.A, dtype=np.float64)
            g = np.frombuffer(lg.g, dtype=np.float64)
            k = np.frombuffer(lg.k, dtype=np.int64)
            n = np.frombuffer(lg.n, dtype=np.int64).astype(np.float64)
            old = np.frombuffer(lg.old, dtype=np.int64)
            prev = np.frombuffer(lg.prev, dtype=np.float64)
            m = old != 0
            vals.append((t0[m] + A[m]) - prev[m])
            wts.append(old[m].astype(np.float64))
            # short runs: every step j = 1 .. k-1
            sh = np.nonzero((k > 1) & (k - 1 <= P))[0]
            if sh.size:
                c = k[sh] - 1
                idx = np.repeat(sh, c)
                starts = np.cumsum(c) - c
                j = (np.arange(idx.size) - np.repeat(starts, c) + 1).astype(np.float64)
                vals.append(A[idx] + g[idx] * j)
                wts.append(n[idx])
            # long runs: P evenly spaced points of the series
            lo_ = np.nonzero(k - 1 > P)[0]
            if lo_.size:
                kk = k[lo_].astype(np.float64)[:, None]
                i = (np.arange(P, dtype=np.float64) + 0.5)[None, :]
                j = 1 + (kk - 2) * i / P
                vals.append((A[lo_][:, None] + g[lo_][:, None] * j).ravel())
                wts.append(np.repeat(n[lo_] * (k[lo_] - 1) / P, P))
        # each round's first gap: first token -> end of its first step
        wk: list[int] = []
        lo_idx: list[int] = []
        ft: list[float] = []
        for sess in self.sessions:
            for r in sess.rounds:
                if r.n_tokens > 1:
                    wk.append(r.worker)
                    lo_idx.append(r.step_lo)
                    ft.append(r.first_token)
        if wk:
            wk_a = np.asarray(wk, dtype=np.int64)
            lo_a = np.asarray(lo_idx, dtype=np.int64)
            ft_a = np.asarray(ft, dtype=np.float64)
            first = np.empty(ft_a.size)
            for w in np.unique(wk_a):
                sel = wk_a == w
                lg = logs[int(w)]
                LO = np.frombuffer(lg.lo, dtype=np.int64)
                s = np.searchsorted(LO, lo_a[sel], side="right") - 1
                jj = (lo_a[sel] - LO[s]).astype(np.float64)
                T0 = np.frombuffer(lg.t0, dtype=np.float64)[s]
                AA = np.frombuffer(lg.A, dtype=np.float64)[s]
                GG = np.frombuffer(lg.g, dtype=np.float64)[s]
                first[sel] = T0 + (jj + 1) * AA + GG * jj * (jj + 1) * 0.5
            vals.append(first - ft_a)
            wts.append(np.ones(ft_a.size))
        if not vals:
            return np.empty(0), np.empty(0)
        return np.concatenate(vals).astype(np.float64), np.concatenate(wts).astype(np.float64)

    def token_times(self, rnd: SimRound) -> tuple[float, ...]:
        """Every token time of a round, first token included."""
        n = rnd.n_tokens
        if n <= 0:
            return ()
        if n == 1:
            return (rnd.first_token,)
        return (rnd.first_token, *self.step_logs[rnd.worker].ends(rnd.step_lo, n - 1))

    def itl_gaps(self, rnd: SimRound) -> list[float]:
        t = self.token_times(rnd)
        return [b - a for a, b in zip(t, t[1:])]

    def itl_max(self, rnd: SimRound) -> float:
        g = self.itl_gaps(rnd)
        return max(g) if g else 0.0


class Simulator:
    def __init__(self, cfg: SimConfig):
        from ampd.policy import SLO, bind, make_queue, make_router

        self.cfg = cfg
        prof = cfg.profile
        self.profile = prof
        spec = policy_shape(cfg.policy)
        self.spec = spec
        colocated = not spec.uses_prefill_workers
        self.colocated = colocated
        self.kv_pin_ttl_s = spec.kv_pin_ttl_s
        pre_groups = parse_spec(cfg.prefill) if isinstance(cfg.prefill, (str, type(None))) else tuple(cfg.prefill)
        dec_groups = parse_spec(cfg.decode) if isinstance(cfg.decode, (str, type(None))) else tuple(cfg.decode)
        if not dec_groups:
            raise ValueError("the deployment needs at least one decode worker")
        if colocated and pre_groups:
            raise ValueError(f"policy {cfg.policy!r} is co-located: it takes no prefill workers "
                             f"(got --prefill {format_spec(pre_groups)})")
        tps = set(prof.tps)
        for tp, _ in (*pre_groups, *dec_groups):
            if tp not in tps:
                raise ValueError(f"TP {tp} is not in profile {prof.name!r} (it covers {sorted(tps)})")
        self.prefill_spec = format_spec(pre_groups)
        self.decode_spec = format_spec(dec_groups)
        slo = SLO(ttft_s=cfg.ttft_slo_s, itl_s=cfg.itl_slo_s)
        self.slo = slo
        self.router = make_router(cfg.policy, prof, slo, seed=cfg.seed, **cfg.router_options)
        self._bind = bind
        w = cfg.window_s
        self.decodes = [
            _Decode(i, tp, make_queue(spec.decode_queue, prof, slo, tp, window=cfg.queue_window),
                    int(prof.kv_capacity_tokens(tp)), w)
            for i, tp in enumerate(expand_spec(dec_groups))
        ]
        self.prefills = [
            _Prefill(i, tp, make_queue(spec.prefill_queue or "fcfs", prof, slo, tp, window=cfg.queue_window),
                     int(prof.kv_capacity_tokens(tp)), w)
            for i, tp in enumerate(expand_spec(pre_groups))
        ]
        self.by_id = {d.wid: d for d in self.decodes}
        self.by_id.update({p.wid: p for p in self.prefills})
        self._flush = None
        # t_dec must be affine in the context for runs of steps to have closed-form times;
        # checked per TP degree (else one event per step)
        self.ctx_coef: dict[int, float] = {}
        for tp in {*expand_spec(dec_groups)}:
            c = _affine_ctx_coef(prof, tp)
            if c is not None:
                self.ctx_coef[tp] = c
        self.gpus = sum(tp * r for tp, r in (*pre_groups, *dec_groups))
        # chunked local prefill (beyond the paper): chunk size per TP from the profile, as live
        self.chunk_tokens = ({tp: int(prof.prefill_chunk_tokens(tp)) for tp in {*expand_spec(dec_groups)}}
                             if cfg.chunked_prefill else {})

    # ----------------------------------------------------------------- views for the policy cores
    def _decode_view(self, d: _Decode, now: float):
        from ampd.policy import WorkerView

        if d.state == _STEPPING and self._flush is not None:
            self._flush(d, _steps_done(now - d.seg_t0, d.seg_A, d.seg_g, d.seg_m))
        return WorkerView(worker_id=d.wid, kind="decode", tp=d.tp, window_mean_s=d.win.mean(now),
                          queue=tuple(d.queue.tasks()), kv_free_tokens=d.kv_cap - d.kv_used - d.wait_need,
                          queue_predicted_s=d.queue.predicted_total())

    def _prefill_view(self, p: _Prefill, now: float):
        from ampd.policy import WorkerView

        return WorkerView(worker_id=p.wid, kind="prefill", tp=p.tp, window_mean_s=p.win.mean(now),
                          queue=tuple(p.queue.tasks()), kv_free_tokens=p.kv_cap,
                          queue_predicted_s=p.queue.predicted_total())

    # ----------------------------------------------------------------------------------- the run
    def run(self, sessions: Sequence) -> SimResult:
        with gc_paused():
            return self._run(sessions)

    def _run(self, sessions: Sequence) -> SimResult:
        from ampd.policy import PrefillRequest, QueuedTask, WorkerView

        wall0 = _time.perf_counter()
        cfg = self.cfg
        prof = self.profile
        t_pre = prof.t_pre
        t_dec = prof.t_dec
        t_kv = prof.t_kv
        ctx_coef = self.ctx_coef
        chunk_tokens = self.chunk_tokens
        contention = cfg.kv_contention
        decodes = self.decodes
        prefills = self.prefills
        by_id = self.by_id
        router = self.router
        bind = self._bind
        heap: list = []
        push = heapq.heappush
        pop = heapq.heappop
        seq = 0
        live: dict[str, _Sess] = {}
        outcomes: list[SimSession] = []
        n_events = 0
        n_local = 0
        n_remote = 0
        n_overcommit = 0
        n_evictions = 0
        pin_ttl = self.kv_pin_ttl_s
        path = cfg.path
        open_s, dispatch_s, handoff_s, tool_rpc_s = path.open_s, path.dispatch_s, path.handoff_s, path.tool_s
        busy_extra = path.prefill_busy_s
        reasons: dict[str, int] = {}

        order = sorted(range(len(sessions)), key=lambda i: (sessions[i].arrival, i))
        ids_seen: set = set()

        # ---- helpers (closures: local-variable access is the fastest in CPython)
        def run_chunk(d: _Decode, now: float):
            nonlocal seq
            st, done = d.chunk
            n = min(chunk_tokens[d.tp], st.l_incr - done)
            dur = t_pre(d.tp, st.l_hist + done, n)
            d.chunk[1] = done + n
            d.chunk_step_due = True
            d.state = _PREFILLING
            d.busy_until = now + dur
            d.busy_s += dur
            seq += 1
            push(heap, (now + dur, seq, _LOCAL_CHUNK, st))

        def decode_next(d: _Decode, now: float):
            nonlocal seq
            if d.chunk is not None and not (d.chunk_step_due and (d.batch_n or d.pending)):
                run_chunk(d, now)
                return
            if d.qlen and d.chunk is None:
                task = d.queue.pop(now)
                d.qver += 1
                d.qlen -= 1
                st = live[task.session_id]
                if chunk_tokens and task.l_incr > chunk_tokens[d.tp]:
                    d.chunk = [st, 0]
                    run_chunk(d, now)
                    return
                dur = t_pre(d.tp, task.l_hist, task.l_incr)
                d.state = _PREFILLING
                d.busy_until = now + dur
                d.busy_s += dur
                seq += 1
                push(heap, (now + dur, seq, _LOCAL_DONE, st))
                return
            pend = d.pending
            new = 0
            ft = 0.0
            if pend:
                k = d.step_idx
                exit_at = d.exit_at
                for st in pend:
                    st.lo = k
                    c = st.l_hist + st.l_incr + 1
                    st.ctx_join = c
                    d.ctx_sum += c
                    ex = k + st.out - 2  # index of the session's last step
                    b = exit_at.get(ex)
                    if b is None:
                        exit_at[ex] = [st]
                        heapq.heappush(d.exit_heap, ex)
                    else:
                        b.append(st)
                    ft += st.first
                new = len(pend)
                d.batch_n += new
                pend.clear()
            n = d.batch_n
            if n:
                A = t_dec(d.tp, n, d.ctx_sum)
                c = ctx_coef.get(d.tp)
                if c is None or d.chunk is not None:  # one step between two prefill chunks
                    m = 1
                    g = 0.0 if c is None else c * n
                    d.chunk_step_due = False
                else:
                    # a run of steps up to the next exit from the batch (cut short when a session
                    # joins or a local prefill arrives: see interrupt())
                    m = d.exit_heap[0] - d.step_idx + 1
                    g = c * n
                d.state = _STEPPING
                d.step_new = new
                d.step_ft = ft
                d.seg_t0 = now
                d.seg_A = A
                d.seg_g = g
                d.seg_m = m
                d.seg_flushed = 0
                d.cut = False
                d.seg_ver += 1
                seq += 1
                push(heap, (now + m * A + g * m * (m - 1) * 0.5, seq, _STEP_DONE, (d, d.seg_ver)))
            else:
                d.state = _IDLE

        def interrupt(d: _Decode, now: float):
            """Something for this worker arrived mid-run: end the run at the next step boundary."""
            nonlocal seq
            if d.cut:
                return
            d.cut = True
            A, g, m = d.seg_A, d.seg_g, d.seg_m
            q = _steps_done(now - d.seg_t0, A, g, m)
            # the step in progress (index q) ends the run; if q steps ended exactly at now, the
            # boundary is now
            if q >= 1 and d.seg_t0 + q * A + g * (q - 1) * q * 0.5 >= now:
                k = q
            else:
                k = q + 1
            if k < m:
                d.seg_m = k
                d.seg_ver += 1
                seq += 1
                push(heap, (d.seg_t0 + k * A + g * (k - 1) * k * 0.5, seq, _STEP_DONE, (d, d.seg_ver)))

        def flush(d: _Decode, upto: int):
            """Account steps [seg_flushed, upto) of the current run: window samples."""
            a = d.seg_flushed
            if upto <= a:
                return
            A, g, n, t0 = d.seg_A, d.seg_g, d.batch_n, d.seg_t0
            gsum = 0.0
            if a == 0:
                e0 = t0 + A
                gsum = n * e0 - (n - d.step_new) * d.last_end - d.step_ft
                a = 1
            if upto > a:
                gsum += n * ((upto - a) * A + g * (a + upto - 1) * (upto - a) * 0.5)
            cnt = n * (upto - d.seg_flushed)
            d.win.add(t0 + upto * A + g * (upto - 1) * upto * 0.5, gsum / cnt, cnt)
            d.wadds += 1
            d.seg_flushed = upto

        def prefill_next(p: _Prefill, now: float):
            nonlocal seq
            if p.busy or not p.qlen:
                return
            task = p.queue.pop(now)
            p.qver += 1
            p.qlen -= 1
            st = live[task.session_id]
            d = st.dw
            lh = task.l_hist
            li = task.l_incr
            comp = t_pre(p.tp, lh, li)
            p.busy = True
            p.tasks += 1
            st.pw = p
            read = t_kv(lh, d.tp, p.tp) if lh > 0 else 0.0
            write = t_kv(li, p.tp, d.tp)
            if contention:
                if lh > 0:
                    start = max(now, d.nic, p.nic)
                    rend = start + read
                    d.nic = p.nic = rend
                else:
                    rend = now
                st.write_s = write
                p.busy_until = rend + comp + write
                p.busy_s += rend - now + comp + busy_extra
                seq += 1
                push(heap, (rend + comp + busy_extra, seq, _COMPUTE_DONE, st))
            else:
                dur = read + comp + write
                p.busy_until = now + dur
                p.busy_s += dur + busy_extra
                seq += 1
                push(heap, (now + dur + busy_extra, seq, _REMOTE_DONE, st))

        def first_token(st: _Sess, now: float):
            st.first = now
            d = st.dw
            d.kv_used += 1
            if st.out <= 1:
                round_end(st, now, now)
            else:
                d.pending.append(st)
                if d.state == _IDLE:
                    decode_next(d, now)
                elif d.state == _STEPPING:
                    interrupt(d, now)

        def round_end(st: _Sess, now: float, last: float):
            nonlocal seq
            d = st.dw
            out = st.out
            st.rec.rounds.append(SimRound(st.r, st.ready, st.first, last, out, st.local, d.idx,
                                          st.lo if out > 1 else 0, st.target))
            st.l_hist += st.l_incr + out
            rounds = st.rounds
            if st.r + 1 < len(rounds):
                tool = rounds[st.r].tool_s
                tool = (tool if tool and tool > 0 else 0.0) + tool_rpc_s
                st.r += 1
                seq += 1
                push(heap, (now + tool, seq, _ROUND_READY, st))
                if pin_ttl is not None and tool > pin_ttl:
                    st.in_tool = True
                    seq += 1
                    push(heap, (now + pin_ttl, seq, _PIN_EXPIRED, st))
            else:
                d.kv_used -= st.l_hist
                d.live -= 1
                st.rec.completed = True
                st.rec.end = now
                del live[st.sid]
                admit_waiters(d, now)

        def make_room(d: _Decode, need: int):
            nonlocal n_evictions
            ev = d.evictable
            while ev and d.kv_cap - d.kv_used < need:
                # Continuum: a session whose KV pin expired during its tool call loses its KV
                # (its next round re-prefills the whole context)
                v = ev.popleft()
                if v.in_tool and not v.evicted:
                    v.evicted = True
                    d.kv_used -= v.l_hist
                    n_evictions += 1
            return d.kv_cap - d.kv_used >= need

        def admit_waiters(d: _Decode, now: float):
            nonlocal n_overcommit
            w = d.kv_wait
            while w:
                st = w[0]
                if make_room(d, st.l_incr):
                    pass
                elif len(w) >= d.live:
                    # every running session on this worker waits for KV: nobody will free any, so
                    # the head goes ahead over capacity rather than deadlock (counted in stats)
                    n_overcommit += 1
                else:
                    return
                w.popleft()
                d.wait_need -= st.l_incr
                d.kv_used += st.l_incr
                dispatch(st, now)
            nw = d.new_wait
            while nw:
                st = nw[0]
                if make_room(d, st.l_incr):
                    pass
                elif d.live == 0:
                    n_overcommit += 1  # a single session larger than the whole worker
                else:
                    return
                nw.popleft()
                d.wait_need -= st.l_incr
                d.live += 1
                d.kv_used += st.l_incr
                dispatch(st, now)

        def round_ready(st: _Sess, now: float):
            rnd = st.rounds[st.r]
            st.ready = now
            st.l_incr = int(rnd.input)
            st.out = int(rnd.output)
            d = st.dw
            st.in_tool = False
            if st.evicted:
                st.evicted = False
                st.l_incr += st.l_hist
                st.l_hist = 0
            if st.r == 0:
                # a new session starts only when its first input fits; running sessions go first
                if d.kv_wait or d.new_wait or d.kv_cap - d.kv_used < st.l_incr:
                    d.new_wait.append(st)
                    d.wait_need += st.l_incr
                    admit_waiters(d, now)
                    return
                d.live += 1
            elif d.kv_wait or d.kv_cap - d.kv_used < st.l_incr:
                d.kv_wait.append(st)
                d.wait_need += st.l_incr
                admit_waiters(d, now)
                return
            d.kv_used += st.l_incr
            dispatch(st, now)

        pviews_static = not prefills
        self._flush = flush

        window_s = cfg.window_s

        def win_mean(x, now: float):
            """x.win.mean(now), remembering when it can next change (an add, or the oldest sample
            expiring: WindowedMean drops samples older than now - window_s)."""
            w = x.win
            mean = w.mean(now)
            smp = w._samples
            x.m_t0 = smp[0][0] if smp else math.inf
            x.m_adds = x.wadds
            x.m_mean = mean
            return mean

        def decode_view(d: _Decode, now: float):
            """``Simulator._decode_view``, cached: the same WorkerView object while no field changed."""
            if d.state == _STEPPING:
                flush(d, _steps_done(now - d.seg_t0, d.seg_A, d.seg_g, d.seg_m))
            if d.m_adds == d.wadds and d.m_t0 >= now - window_s:
                mean = d.m_mean  # no sample added or expired since the last read
            else:
                mean = win_mean(d, now)
            free = d.kv_cap - d.kv_used - d.wait_need
            v = d.view
            residual = d.busy_until - now if d.state == _PREFILLING and d.busy_until > now else 0.0
            if d.vq_ver != d.qver:
                d.vq = tuple(d.queue.tasks())
                d.vpred = d.queue.predicted_total()
                d.vq_ver = d.qver
            elif v is not None and mean == d.v_mean and free == d.v_free and not residual:
                return v
            v = WorkerView(worker_id=d.wid, kind="decode", tp=d.tp, window_mean_s=mean, queue=d.vq,
                           kv_free_tokens=free, queue_predicted_s=d.vpred + residual)
            d.view = v
            d.v_mean = mean
            d.v_free = free
            return v

        def prefill_view(p: _Prefill, now: float):
            """``Simulator._prefill_view``, cached likewise."""
            if p.m_adds == p.wadds and p.m_t0 >= now - window_s:
                mean = p.m_mean
            else:
                mean = win_mean(p, now)
            v = p.view
            residual = p.busy_until - now if p.busy and p.busy_until > now else 0.0
            if p.vq_ver != p.qver:  # the queue changed: copy it once, not per view
                p.vq = tuple(p.queue.tasks())
                p.vpred = p.queue.predicted_total()
                p.vq_ver = p.qver
            elif v is not None and mean == p.v_mean and not residual:
                return v
            v = WorkerView(worker_id=p.wid, kind="prefill", tp=p.tp, window_mean_s=mean,
                           queue=p.vq, kv_free_tokens=p.kv_cap, queue_predicted_s=p.vpred + residual)
            p.view = v
            p.v_mean = mean
            return v

        def route(st: _Sess, now: float):
            nonlocal n_local, n_remote
            d = st.dw
            req = PrefillRequest(session_id=st.sid, round=st.r, l_hist=st.l_hist, l_incr=st.l_incr,
                                 decode_worker=d.wid)
            dview = decode_view(d, now)
            pviews = () if pviews_static else [prefill_view(p, now) for p in prefills]
            dec = router.route(req, dview, pviews, now)
            reasons[dec.reason] = reasons.get(dec.reason, 0) + 1
            task = QueuedTask(session_id=st.sid, round=st.r, l_hist=st.l_hist, l_incr=st.l_incr,
                              enqueued_at=st.ready)
            if dec.local or dec.target == d.wid:
                st.local = True
                st.target = d.wid
                n_local += 1
                d.queue.push(task)
                d.qver += 1
                d.qlen += 1
                if d.state == _IDLE:
                    decode_next(d, now)
                elif d.state == _STEPPING:
                    interrupt(d, now)
            else:
                p = by_id.get(dec.target)
                if not isinstance(p, _Prefill):
                    raise RuntimeError(f"router {cfg.policy!r} chose unknown prefill worker {dec.target!r}")
                st.local = False
                st.target = p.wid
                n_remote += 1
                p.queue.push(task)
                p.qver += 1
                p.qlen += 1
                prefill_next(p, now)

        def dispatch_later(st: _Sess, now: float):
            """Route the round once the control path has carried it (PathLatency)."""
            nonlocal seq
            delay = dispatch_s + open_s if st.r == 0 else dispatch_s
            if delay:
                seq += 1
                push(heap, (now + delay, seq, _DISPATCH, st))
            else:
                route(st, now)

        dispatch = route if not (open_s or dispatch_s) else dispatch_later

        def arrive(s, now: float):
            sid = str(s.id)
            if sid in ids_seen:
                raise ValueError(f"duplicate session id {sid!r} in the trace")
            ids_seen.add(sid)
            rec = SimSession(sid, float(s.arrival), "")
            outcomes.append(rec)
            if not s.rounds:
                rec.completed = True
                rec.end = now
                return
            target = bind([decode_view(d, now) for d in decodes])
            d = by_id[target]
            rec.decode_worker = d.wid
            st = _Sess(sid, s.rounds, rec)
            st.dw = d
            live[sid] = st
            round_ready(st, now)

        # ---- main loop: arrivals are merged lazily with the event heap
        ai = 0
        na = len(order)
        next_arr = float(sessions[order[0]].arrival) if na else math.inf
        now = 0.0
        while True:
            if heap and heap[0][0] <= next_arr:
                now, _, code, obj = pop(heap)
            elif ai < na:
                now = next_arr
                arrive(sessions[order[ai]], now)
                ai += 1
                next_arr = float(sessions[order[ai]].arrival) if ai < na else math.inf
                n_events += 1
                continue
            else:
                break
            n_events += 1
            if code == _STEP_DONE:
                d, ver = obj
                if ver != d.seg_ver:
                    continue  # a run that was cut short
                k = d.seg_m
                n = d.batch_n
                k0 = d.step_idx
                flush(d, k)
                lg = d.log
                lg.lo.append(k0)
                lg.t0.append(d.seg_t0)
                lg.A.append(d.seg_A)
                lg.g.append(d.seg_g)
                lg.k.append(k)
                lg.n.append(n)
                lg.old.append(n - d.step_new)
                lg.prev.append(d.last_end)
                d.busy_s += now - d.seg_t0
                d.last_end = now
                d.step_idx = k0 + k
                d.ctx_sum += n * k
                d.kv_used += n * k
                exits = d.exit_at.pop(k0 + k - 1, None)
                if exits:
                    heapq.heappop(d.exit_heap)
                    d.batch_n = n - len(exits)
                    for st in exits:
                        d.ctx_sum -= st.ctx_join + st.out - 1
                    for st in exits:
                        round_end(st, now, now)
                decode_next(d, now)
            elif code == _REMOTE_DONE:
                st = obj
                p = st.pw
                p.busy = False
                st.pw = None
                p.win.add(now, now - st.ready, 1)
                p.wadds += 1
                if handoff_s:
                    seq += 1
                    push(heap, (now + handoff_s, seq, _HANDOFF, st))
                else:
                    first_token(st, now)
                prefill_next(p, now)
            elif code == _LOCAL_CHUNK:
                st = obj
                d = st.dw
                d.state = _IDLE
                if d.chunk[1] >= st.l_incr:
                    d.chunk = None
                    d.chunk_step_due = False
                    first_token(st, now)
                if d.state == _IDLE:
                    decode_next(d, now)
            elif code == _LOCAL_DONE:
                st = obj
                d = st.dw
                d.state = _IDLE
                first_token(st, now)
                if d.state == _IDLE:
                    decode_next(d, now)
            elif code == _ROUND_READY:
                round_ready(obj, now)
            elif code == _DISPATCH:
                route(obj, now)
            elif code == _HANDOFF:
                first_token(obj, now)
            elif code == _PIN_EXPIRED:
                st = obj
                if st.in_tool and not st.evicted:
                    st.dw.evictable.append(st)
                    if st.dw.kv_wait or st.dw.new_wait:
                        admit_waiters(st.dw, now)
            elif code == _COMPUTE_DONE:
                st = obj
                p = st.pw
                d = st.dw
                start = max(now, d.nic, p.nic)
                end = start + st.write_s
                d.nic = p.nic = end
                p.busy_s += end - now
                seq += 1
                push(heap, (end, seq, _REMOTE_DONE, st))

        wall = _time.perf_counter() - wall0
        unfinished = len(live)
        for st in live.values():
            st.rec.completed = False
        stats = {
            "events": n_events,
            "wall_s": wall,
            "sessions_per_s": (len(sessions) / wall) if wall > 0 else math.inf,
            "sim_end_s": now,
            "local_prefills": n_local,
            "remote_prefills": n_remote,
            "route_reasons": reasons,
            "kv_overcommits": n_overcommit,
            "kv_evictions": n_evictions,
            "unfinished_sessions": unfinished,
            "decode_steps": [d.step_idx for d in decodes],
            "decode_busy_fraction": [d.busy_s / now if now > 0 else 0.0 for d in decodes],
            "prefill_busy_fraction": [p.busy_s / now if now > 0 else 0.0 for p in prefills],
            "kv_used_end": [d.kv_used for d in decodes],
            "gpus": self.gpus,
            "prefill_spec": self.prefill_spec,
            "decode_spec": self.decode_spec,
        }
        return SimResult(cfg.policy, outcomes, [d.log for d in decodes], now, stats,
                         [d.wid for d in decodes])


def simulate(sessions: Iterable, profile, *, policy: str, prefill="none", decode="tp1*1",
             ttft_slo_s: float = 1.0, itl_slo_s: float = 0.1, seed: int = 0, window_s: float = 10.0,
             kv_contention: bool = False, queue_window: int = 3, chunked_prefill: bool = False,
             path: PathLatency | None = None, **router_options) -> SimResult:
    """Run ``sessions`` (``ampd.workload.Session``s) on a deployment; see ``SimConfig``."""
    cfg = SimConfig(profile=profile, policy=policy, prefill=prefill, decode=decode,
                    ttft_slo_s=ttft_slo_s, itl_slo_s=itl_slo_s, seed=seed, window_s=window_s,
                    kv_contention=kv_contention, queue_window=queue_window,
                    chunked_prefill=chunked_prefill, router_options=router_options,
                    path=path or PathLatency())
    sess = list(sessions)
    return Simulator(cfg).run(sess)
