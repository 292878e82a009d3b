"""A decode worker's runs and what they show: the work items (``LocalPrefill``, ``DecodeRun``), the
closed-form step times of a run, and the half of ``DecodeCore`` that turns runs into ITL samples and
the published view (``ampd.worker.decode`` gives the protocol)."""
from __future__ import annotations

from typing import Final
import math
from dataclasses import dataclass

from ampd.policy.reorder import PrefillQueue
from ampd.policy.types import PrefillTask, WorkerView
from ampd.window import WindowedMean

from .decode_kv import DecodeSession, KvAdmission

__all__ = ["LocalPrefill", "DecodeRun", "RunWindow", "steps_done", "affine_ctx_coef", "IDLE", "STEPPING",
           "PREFILLING"]

# worker states
IDLE: Final = 0
STEPPING: Final = 1
PREFILLING: Final = 2


@dataclass(slots=True, init=False)
class LocalPrefill:
    """Prefill ``tokens`` tokens of ``session``'s round now, ``seconds`` long (ending at ``end``).
    ``last`` is False for a chunk that does not finish the prefill."""

    session: DecodeSession
    tokens: int
    seconds: float
    end: float
    last: bool

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, session: DecodeSession, tokens: int, seconds: float, end: float, last: bool) -> None:
        self.session = session
        self.tokens = tokens
        self.seconds = seconds
        self.end = end
        self.last = last


@dataclass(slots=True, init=False)
class DecodeRun:
    """Up to ``steps`` decode steps of a fixed batch of ``batch`` sessions from now; step ``j``
    lasts ``first_s + growth_s * j``; the last one ends at ``end``."""

    steps: int
    first_s: float
    growth_s: float
    batch: int
    end: float

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, steps: int, first_s: float, growth_s: float, batch: int, end: float) -> None:
        self.steps = steps
        self.first_s = first_s
        self.growth_s = growth_s
        self.batch = batch
        self.end = end


def steps_done(x: float, A: float, g: float, m: int) -> int:
    """How many steps of a run (step j lasts A + g*j) have ended within time x of its start."""
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


def affine_ctx_coef(cost, tp: int) -> float | None:
    """c such that t_dec(tp, b, x) == t_dec(tp, b, 0) + c * x for the probed b and x, or None."""
    X = 1_000_000
    c = None
    for b in (1, 2, 7, 33, 128, 512):
        t0 = cost.t_dec(tp, b, 0)
        cb = (cost.t_dec(tp, b, X) - t0) / X
        if cb < 0:
            return None
        for x in (1, 977, 65_536, 4_000_000):
            if not math.isclose(cost.t_dec(tp, b, x), t0 + cb * x, rel_tol=1e-9, abs_tol=1e-12):
                return None
        if c is None:
            c = cb
        elif not math.isclose(c, cb, rel_tol=1e-9, abs_tol=1e-15):
            return None
    return c


class RunWindow(KvAdmission):
    """The ITL window fed by the runs, and the published view (a part of ``DecodeCore``; its slots
    are ``KvAdmission``'s and these)."""

    __slots__ = ("state", "window", "last_end", "run_t0", "run_first_s", "run_growth_s", "run_steps", "run_flushed",
                 "run_joined", "run_joined_first", "busy_until", "queue", "queue_ver", "view_tasks", "view_queue",
                 "view_queue_ver", "view_queue_s", "last_view")
    state: int
    window: WindowedMean
    last_end: float
    run_t0: float
    run_first_s: float
    run_growth_s: float
    run_steps: int
    run_flushed: int
    run_joined: int
    run_joined_first: float
    busy_until: float
    queue: PrefillQueue
    queue_ver: int
    view_tasks: bool
    view_queue: tuple[PrefillTask, ...]
    view_queue_ver: int
    view_queue_s: float
    last_view: WorkerView | None

    def _flush(self, upto: int) -> None:
        """Steps [run_flushed, upto) of the run join the ITL window (one sample of their mean gap).
        The run's first gap of a session that was in the batch before it includes any prefill pause;
        a joining session's first gap runs from its first token."""
        a = self.run_flushed
        if upto <= a:
            return
        A, g, n, t0 = self.run_first_s, self.run_growth_s, self.batch_size, self.run_t0
        gsum = 0.0
        if a == 0:
            e0 = t0 + A
            gsum = n * e0 - (n - self.run_joined) * self.last_end - self.run_joined_first
            a = 1
        if upto > a:
            gsum += n * ((upto - a) * A + g * (a + upto - 1) * (upto - a) * 0.5)
        cnt = n * (upto - self.run_flushed)
        self.window.add(t0 + upto * A + g * (upto - 1) * upto * 0.5, gsum / cnt, cnt)
        self.run_flushed = upto

    # ------------------------------------------------------------------------------------ view
    def view(self, now: float) -> WorkerView:
        """The published view: windowed ITL (the steps of the run in progress that ended by now
        count), free KV (less what waiting rounds need), the local queue, and ``queue_predicted_s``
        (the queued prefills plus the remaining time of the one in service). The same object is
        returned while nothing in it changed."""
        if self.state == STEPPING:
            # steps_done is 0 before the first step ends and flush has nothing to add once the run
            # is flushed whole: skip both calls then (a view is read per routing decision)
            x = now - self.run_t0
            if x >= self.run_first_s and self.run_flushed < self.run_steps:
                self._flush(steps_done(x, self.run_first_s, self.run_growth_s, self.run_steps))
        mean = self.window.mean(now)
        free = self.kv_cap - self.kv_used - self.wait_need
        residual = self.busy_until - now if self.state == PREFILLING and self.busy_until > now else 0.0
        if self.view_queue_ver != self.queue_ver:
            if self.view_tasks:
                self.view_queue = self.queue.tasks()
            self.view_queue_s = self.queue.predicted_total()
            self.view_queue_ver = self.queue_ver
        pred = self.view_queue_s + residual
        v = self.last_view
        # the last view holds while everything it shows is unchanged, its predicted queue included
        # (a view cached during a local prefill must not outlive the prefill's residual time)
        if (v is not None and v.queue is self.view_queue and mean == v.window_mean_s and free == v.kv_free_tokens
                and pred == v.queue_predicted_s):
            return v
        # positional, in WorkerView's field order (worker_id, kind, tp, window_mean_s, queue,
        # kv_free_tokens, queue_predicted_s): 174 ns against 535 ns with keywords (timeit); a view
        # is built per run of steps and read per routing decision
        v = self.last_view = WorkerView(self.worker_id, "decode", self.tp, mean, self.view_queue, free, pred)
        return v
