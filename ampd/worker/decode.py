"""Decode worker core: KV admission, the continuous batch, the local prefill queue, chunked local
prefill, windowed ITL and the published view.

Pure: no I/O, no clock; every call takes the time. A driver (the live decode service, the simulator)
feeds it events and runs what it says::

    core.round_ready(s, now)   -> ADMITTED | WAITING | FAILED   a round's input is ready: KV admission
    core.admit_next(now)       -> DecodeSession | None   a waiting round whose KV now fits (loop on it
                                                      after WAITING, round_end(last), a True
                                                      tool_call and pin_expired)
    core.victims               list[DecodeSession]   whose KV the last admission evicted (kv_evict):
                                                      a live driver frees their blocks
    core.make_room(tokens)     -> bool               live: evict idle KV until ``tokens`` fit
    core.submit_local(task)                           a prefill routed to this worker (its local queue)
    core.schedule(now)         -> LocalPrefill | DecodeRun | None   when idle: what runs next
    core.prefill_done(now)     -> DecodeSession | None   the prefill (or chunk) ended; a session whose
                                                      prefill is complete is returned: first token
    core.first_token(s, now)   -> bool               False: the round ended with its first token
    core.run_done(k, now)      -> list[DecodeSession] k steps of the run ended: the sessions whose
                                                      round ended with them
    core.cut(now)              -> float | None       work arrived mid-run: end it at the next step
                                                      boundary (the new end time, or None)
    core.stop_early(s, tokens)                        live: a round ended before its planned length
    core.round_end(s, last)                           account the round's KV (release on the last)
    core.tool_call(s, pin)     -> bool               between rounds: the session waits for a tool
                                                      result (or its next turn); True: it is evictable
                                                      and rounds wait (loop on admit_next)
    core.rewind(s, tokens)                            between rounds: the history shrinks (an edit)
    core.pin_expired(s)        -> bool               a pinned session's KV may be evicted
    core.view(now)             -> WorkerView
    core.step_done(now)        -> list[DecodeSession] live: the run's first step ended (measured)
    core.batch()               -> list[DecodeSession] live: the sessions of the run in progress
    core.drop(s)               -> bool               live: the session ended early (cancel, failure)

After any call, a driver calls ``schedule`` when ``state == IDLE`` and ``cut`` when it is ``STEPPING``
and new work (a joining session, a local prefill) arrived.

Decode runs: a ``DecodeRun`` is ``steps`` decode steps with a fixed batch, step ``j`` lasting
``first_s + growth_s * j`` (the batch's context grows by ``batch`` tokens a step, and ``t_dec`` is
affine in the context). It runs up to the next exit from the batch. The simulator schedules one event
for the whole run (cut short by ``cut``); the live service runs it step by step and reports each step
with ``run_done(1, now)`` (a run is a plan, not a promise). A profile whose ``t_dec`` is not affine in
the context gets runs of one step.

KV admission (``kv_admission``): a round needs KV for its new input. ``"wait"``: a round whose KV does
not fit waits until KV frees; the next rounds of running sessions go before new sessions, and when
every running session on the worker waits (nobody will free any), the first goes ahead over capacity
rather than deadlock (counted in ``kv_overcommits``). ``"fail"``: the round's session fails ("KV
exhausted") and releases its KV. Decode tokens are charged as they are made (one per step per
session; one for the round's first token) and never refused.

Eviction: a session idle between rounds (in a tool call, or waiting for its client's next turn) is
*evictable* at once with ``kv_evict``, or once its KV pin expires (Continuum's TTL, ``pin_expired``).
A round whose KV does not fit first evicts evictable sessions, least recently used first (the one
whose tool call began longest ago), until it fits; only then does it wait or fail. An evicted
session's next round prefills its whole context again (``l_hist`` 0; ``kv_recomputed_tokens`` counts those
history tokens). docs/architecture.md "KV eviction" says why this victim order.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from ampd.policy.reorder import PrefillQueue
from ampd.policy.types import CostModel, PrefillTask, WorkerView
from ampd.window import STATS_WINDOW_S, CachedWindowMean, WindowedMean

__all__ = ["DecodeCore", "DecodeSession", "LocalPrefill", "DecodeRun", "steps_done", "affine_ctx_coef",
           "IDLE", "STEPPING", "PREFILLING", "ADMITTED", "WAITING", "FAILED", "KV_ADMISSION", "KV_EXHAUSTED"]

# worker states
IDLE = 0
STEPPING = 1
PREFILLING = 2

# round_ready outcomes
ADMITTED = 0
WAITING = 1
FAILED = 2

KV_ADMISSION = ("wait", "fail")
KV_EXHAUSTED = "KV exhausted"


class DecodeSession:
    """What a decode worker keeps of one session: its KV, and its current round's progress.

    A driver sets ``round``, ``l_incr`` (new input tokens) and ``out`` (output tokens the round
    makes; live: its upper bound) before ``round_ready``. The core keeps the rest."""

    __slots__ = ("session_id", "round", "l_hist", "l_incr", "out", "first", "lo", "ctx_join", "in_tool",
                 "evicted", "error")

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.round = 0
        self.l_hist = 0  # KV tokens held before this round
        self.l_incr = 0
        self.out = 0
        self.first = 0.0  # first-token time of the current round
        self.lo = 0  # global index of the round's first decode step on this worker
        self.ctx_join = 0  # context the session brought into the batch
        self.in_tool = False
        self.evicted = False
        self.error = ""


@dataclass(slots=True)
class LocalPrefill:
    """Prefill ``tokens`` tokens of ``session``'s round now, ``seconds`` long (ending at ``end``).
    ``last`` is False for a chunk that does not finish the prefill."""

    session: DecodeSession
    tokens: int
    seconds: float
    end: float
    last: bool


@dataclass(slots=True)
class DecodeRun:
    """Up to ``steps`` decode steps of a fixed batch of ``batch`` sessions from now; step ``j``
    lasts ``first_s + growth_s * j``; the last one ends at ``end``."""

    steps: int
    first_s: float
    growth_s: float
    batch: int
    end: float


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


class DecodeCore(CachedWindowMean):
    """State of one decode worker (see the module docstring for the protocol).

    ``cost`` needs ``t_pre`` and ``t_dec`` (``ampd.perf.Profile``). ``chunk_tokens`` > 0 splits a
    local prefill longer than that into chunks, one decode step of the batch between two chunks.
    The run in progress is ``run_t0``/``run_A``/``run_g``/``run_m`` (start, first step, growth,
    steps); ``run_ver`` changes whenever a run starts or is cut, so a driver can drop stale ends."""

    __slots__ = ("worker_id", "tp", "cost", "queue", "kv_admission", "ctx_coef", "chunk_tokens",
                 "sessions", "state", "batch_n", "ctx_sum", "pending", "exit_at", "exit_heap", "step_idx",
                 "last_end", "step_new", "step_ft", "run_t0", "run_A", "run_g", "run_m", "run_ver",
                 "run_flushed", "run_cut", "kv_cap", "kv_used", "live", "kv_wait", "new_wait", "wait_need",
                 "evictable", "window", "busy_s", "in_prefill", "chunk", "chunk_step_due", "busy_until",
                 "kv_overcommits", "kv_evictions", "kv_evict", "kv_recomputed_tokens", "victims", "evictable_kv",
                 "qver", "qlen",
                 "wadds", "m_adds", "m_t0", "m_mean", "vq_ver", "vq", "vpred", "view_", "v_mean", "v_free")

    def __init__(self, worker_id: str, tp: int, cost: CostModel, queue: PrefillQueue, *,
                 kv_capacity_tokens: int, window_s: float = STATS_WINDOW_S, chunk_tokens: int = 0,
                 kv_admission: str = "wait", kv_evict: bool = False):
        if kv_admission not in KV_ADMISSION:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSION)}, got {kv_admission!r}")
        self.worker_id = worker_id
        self.tp = tp
        self.cost = cost
        self.queue = queue
        self.kv_admission = kv_admission
        self.ctx_coef = affine_ctx_coef(cost, tp)  # None: runs of one step
        self.chunk_tokens = chunk_tokens
        self.sessions: dict[str, DecodeSession] = {}  # admitted sessions by id
        self.state = IDLE
        self.batch_n = 0
        self.ctx_sum = 0  # context tokens of the batch
        self.pending: list[DecodeSession] = []  # sessions with a first token, joining at the next run
        self.exit_at: dict[int, list[DecodeSession]] = {}  # global step index -> sessions ending there
        self.exit_heap: list[int] = []
        self.step_idx = 0  # global index of the next decode step
        self.last_end = 0.0  # end of the last decode step
        self.step_new = 0  # sessions that joined at the run in progress
        self.step_ft = 0.0  # sum of their first-token times
        self.run_t0 = 0.0
        self.run_A = 0.0
        self.run_g = 0.0
        self.run_m = 0
        self.run_ver = 0
        self.run_flushed = 0  # steps of the run already in the ITL window
        self.run_cut = False
        self.kv_cap = kv_capacity_tokens
        self.kv_used = 0
        self.live = 0  # admitted sessions
        self.kv_wait: deque[DecodeSession] = deque()  # next rounds of running sessions waiting for KV
        self.new_wait: deque[DecodeSession] = deque()  # new sessions whose first round waits for KV
        self.wait_need = 0  # KV tokens the waiting rounds need
        # sessions idle between rounds whose KV may be evicted, least recently used first (the order
        # they became evictable in); a session leaves it when its next round is ready or it ends
        self.evictable: OrderedDict[DecodeSession, None] = OrderedDict()
        self.evictable_kv = 0  # KV tokens they hold
        self.kv_evict = kv_evict  # idle sessions are evictable from the start of their tool call
        self.victims: list[DecodeSession] = []  # evicted by the last admission (the driver frees them)
        self.window = WindowedMean(window_s)
        self.busy_s = 0.0
        self.in_prefill: DecodeSession | None = None  # the (unchunked) local prefill in service
        self.chunk: list | None = None  # [session, tokens done] of the chunked local prefill
        self.chunk_step_due = False  # a chunk just ended: one decode step comes next
        self.busy_until = 0.0  # predicted end of the local prefill in service (counts as queued work)
        self.kv_overcommits = 0
        self.kv_evictions = 0
        self.kv_recomputed_tokens = 0  # history tokens prefilled again after an eviction
        self.qver = 0  # pushes + pops of the queue (the view's queue copy is rebuilt when it moves)
        self.qlen = 0
        self.wadds = 0  # window.add calls (the cached mean holds while none was added or expired)
        self.m_adds = -1
        self.m_t0 = math.inf
        self.m_mean: float | None = None
        self.vq_ver = -1
        self.vq: tuple = ()
        self.vpred = 0.0
        self.view_: WorkerView | None = None
        self.v_mean: float | None = None
        self.v_free = 0

    # ------------------------------------------------------------------------------ admission
    def round_ready(self, s: DecodeSession, now: float) -> int:
        """A round's input is ready (``s.round``, ``s.l_incr``, ``s.out`` set): reserve its KV.
        ADMITTED: route it now. WAITING: it waits (then loop on ``admit_next``). FAILED: the session
        failed (``s.error``) and released its KV."""
        if s.in_tool:
            s.in_tool = False
            self._not_evictable(s)
        if s.evicted:
            s.evicted = False
            self.kv_recomputed_tokens += s.l_hist
            s.l_incr += s.l_hist
            s.l_hist = 0
        need = s.l_incr
        if self.kv_admission == "fail":
            if self.kv_cap - self.kv_used < need and not self._make_room(need):
                return self._fail(s)
            if s.session_id not in self.sessions:
                self.live += 1
                self.sessions[s.session_id] = s
        elif s.session_id not in self.sessions:
            # a new session starts only when its first input fits (after evictions); running sessions
            # go first
            if self.kv_wait or self.new_wait or (self.kv_cap - self.kv_used < need and not self._make_room(need)):
                self.new_wait.append(s)
                self.wait_need += need
                return WAITING
            self.live += 1
            self.sessions[s.session_id] = s
        elif self.kv_wait or (self.kv_cap - self.kv_used < need and not self._make_room(need)):
            self.kv_wait.append(s)
            self.wait_need += need
            return WAITING
        self.kv_used += need
        return ADMITTED

    def _fail(self, s: DecodeSession) -> int:
        s.error = f"{KV_EXHAUSTED} on {self.worker_id}: {s.l_incr} tokens needed, {self.kv_cap - self.kv_used} free"
        if s.session_id in self.sessions:
            self.kv_used -= s.l_hist
            self.live -= 1
            self.sessions.pop(s.session_id, None)
        return FAILED

    def admit_next(self, now: float) -> DecodeSession | None:
        """The first waiting round whose KV fits now (evicting expired pins as needed), admitted;
        None when none fits. Running sessions' rounds go first; see the no-deadlock rule above."""
        w = self.kv_wait
        if w:
            s = w[0]
            if not self._make_room(s.l_incr):
                if len(w) < self.live:
                    return None
                # every running session on this worker waits for KV: nobody will free any, so the
                # head goes ahead over capacity rather than deadlock
                self.kv_overcommits += 1
            w.popleft()
            self.wait_need -= s.l_incr
            self.kv_used += s.l_incr
            return s
        nw = self.new_wait
        if nw:
            s = nw[0]
            if not self._make_room(s.l_incr):
                if self.live != 0:
                    return None
                self.kv_overcommits += 1  # a single session larger than the whole worker
            nw.popleft()
            self.wait_need -= s.l_incr
            self.live += 1
            self.sessions[s.session_id] = s
            self.kv_used += s.l_incr
            return s
        return None

    def _make_room(self, need: int) -> bool:
        if self.victims:
            self.victims.clear()
        if self.kv_cap - self.kv_used + self.evictable_kv < need and self.kv_evict:
            # evicting every idle session would not make the room: none loses its KV (vLLM's block
            # allocator checks the same before it evicts cached blocks). Without kv_evict (the
            # simulator's Continuum pins alone) expired pins go anyway, as they always have there:
            # its shipped results stay comparable.
            return False
        ev = self.evictable
        while ev and self.kv_cap - self.kv_used < need:
            # the least recently used idle session loses its KV (its next round re-prefills the
            # whole context)
            v = ev.popitem(last=False)[0]
            v.evicted = True
            self.kv_used -= v.l_hist
            self.evictable_kv -= v.l_hist
            self.kv_evictions += 1
            self.victims.append(v)
        return self.kv_cap - self.kv_used >= need

    def _evictable(self, s: DecodeSession) -> None:
        if s not in self.evictable:
            self.evictable[s] = None
            self.evictable_kv += s.l_hist

    def _not_evictable(self, s: DecodeSession) -> None:
        if self.evictable.pop(s, 0) is None:
            self.evictable_kv -= s.l_hist

    def make_room(self, tokens: int) -> bool:
        """Live: evict idle sessions (``victims``) until ``tokens`` more fit; False when they do not.
        A driver whose pool frees a victim's blocks, not the tokens the core charged it, calls it
        right before reserving, with its capacity set to the pool's real free space."""
        return self._make_room(tokens)

    def round_end(self, s: DecodeSession, last: bool) -> None:
        """The round's last token is made: its input and output join the session's history; the
        last round releases the session's KV (then loop on ``admit_next``)."""
        s.l_hist += s.l_incr + s.out
        if last:
            self.kv_used -= s.l_hist
            self.live -= 1
            del self.sessions[s.session_id]

    def tool_call(self, s: DecodeSession, pin: bool = False) -> bool:
        """The session waits for a tool result (or its client's next turn). ``pin``: its KV stays
        pinned until ``pin_expired`` (Continuum's TTL starts); else with ``kv_evict`` it is evictable
        now. True when it is and a round waits for KV (loop on ``admit_next``)."""
        s.in_tool = True
        if self.kv_evict and not pin and not s.evicted:
            self._evictable(s)
            return bool(self.kv_wait or self.new_wait)
        return False

    def rewind(self, s: DecodeSession, tokens: int) -> None:
        """Between rounds: the session keeps only ``tokens`` of its history (an edited conversation);
        the KV charged for the rest is released (then loop on ``admit_next``)."""
        if not s.in_tool:
            raise ValueError(f"{self.worker_id}: session {s.session_id!r} is in a round")
        drop = s.l_hist - tokens
        if drop > 0:
            if not s.evicted:
                self.kv_used -= drop
                if s in self.evictable:
                    self.evictable_kv -= drop
            s.l_hist = tokens

    def pin_expired(self, s: DecodeSession) -> bool:
        """The session's KV pin expired during its tool call: its KV may be evicted. True when a
        waiting round may now fit (loop on ``admit_next``)."""
        if s.in_tool and not s.evicted:
            self._evictable(s)
            return bool(self.kv_wait or self.new_wait)
        return False

    # -------------------------------------------------------------------------- local prefills
    def submit_local(self, task: PrefillTask) -> None:
        """A prefill routed to this worker joins its local queue."""
        self.queue.push(task)
        self.qver += 1
        self.qlen += 1

    def _chunk(self, now: float) -> LocalPrefill:
        s, done = self.chunk
        n = min(self.chunk_tokens, s.l_incr - done)
        dur = self.cost.t_pre(self.tp, s.l_hist + done, n)
        self.chunk[1] = done + n
        self.chunk_step_due = True
        self.state = PREFILLING
        self.busy_until = now + dur
        self.busy_s += dur
        return LocalPrefill(s, n, dur, now + dur, done + n >= s.l_incr)

    def prefill_done(self, now: float) -> DecodeSession | None:
        """The local prefill or chunk in service ended; the session whose prefill is complete is
        returned (its first token is now: call ``first_token``)."""
        self.state = IDLE
        ch = self.chunk
        if ch is not None:
            if ch[1] >= ch[0].l_incr:
                self.chunk = None
                self.chunk_step_due = False
                return ch[0]
            return None
        s = self.in_prefill
        self.in_prefill = None
        return s

    def first_token(self, s: DecodeSession, now: float) -> bool:
        """The round's first token is made (here or by a remote prefill). False: the round ended
        with it (``round_end`` next); True: the session joins the batch at the next run."""
        s.first = now
        self.kv_used += 1
        if s.out <= 1:
            return False
        self.pending.append(s)
        return True

    # ------------------------------------------------------------------------------- schedule
    def schedule(self, now: float) -> LocalPrefill | DecodeRun | None:
        """When idle: the next thing to run. A chunked prefill alternates with one decode step of
        the batch; else a queued local prefill (Algorithm 2's pick) goes before decoding
        (prefill-priority); else a run of decode steps up to the next exit; else None (idle)."""
        if self.chunk is not None and not (self.chunk_step_due and (self.batch_n or self.pending)):
            return self._chunk(now)
        if self.qlen and self.chunk is None:
            task = self.queue.pop(now)
            self.qver += 1
            self.qlen -= 1
            s = self.sessions[task.session_id]
            if self.chunk_tokens and task.l_incr > self.chunk_tokens:
                self.chunk = [s, 0]
                return self._chunk(now)
            dur = self.cost.t_pre(self.tp, task.l_hist, task.l_incr)
            self.state = PREFILLING
            self.in_prefill = s
            self.busy_until = now + dur
            self.busy_s += dur
            return LocalPrefill(s, task.l_incr, dur, now + dur, True)
        pend = self.pending
        if pend:
            # _join, inlined (once per run that a session joins): the sessions with a first
            # token join the batch at the run about to start
            k = self.step_idx
            exit_at = self.exit_at
            ft = 0.0
            cs = self.ctx_sum
            for s in pend:
                s.lo = k
                c = s.l_hist + s.l_incr + 1
                s.ctx_join = c
                cs += c
                ex = k + s.out - 2  # index of the session's last step
                b = exit_at.get(ex)
                if b is None:
                    exit_at[ex] = [s]
                    heapq.heappush(self.exit_heap, ex)
                else:
                    b.append(s)
                ft += s.first
            self.ctx_sum = cs
            self.step_new = len(pend)
            self.step_ft = ft
            self.batch_n += len(pend)
            pend.clear()
        else:
            self.step_new = 0
            self.step_ft = 0.0
        n = self.batch_n
        if not n:
            self.state = IDLE
            return None
        A = self.cost.t_dec(self.tp, n, self.ctx_sum)
        c = self.ctx_coef
        if c is None or self.chunk is not None:  # one step between two prefill chunks
            m = 1
            g = 0.0 if c is None else c * n
            self.chunk_step_due = False
        else:
            # a run of steps up to the next exit from the batch (cut short when a session joins or
            # a local prefill arrives: see cut())
            m = self.exit_heap[0] - self.step_idx + 1
            g = c * n
        self.state = STEPPING
        self.run_t0 = now
        self.run_A = A
        self.run_g = g
        self.run_m = m
        self.run_flushed = 0
        self.run_cut = False
        self.run_ver += 1
        return DecodeRun(m, A, g, n, now + m * A + g * m * (m - 1) * 0.5)

    def cut(self, now: float) -> float | None:
        """Something for this worker arrived mid-run: end the run at the next step boundary.
        Returns the run's new end (its ``run_ver`` changed), or None when it ends there anyway."""
        if self.run_cut:
            return None
        self.run_cut = True
        A, g, m, t0 = self.run_A, self.run_g, self.run_m, self.run_t0
        q = steps_done(now - t0, A, g, m)
        # the step in progress (index q) ends the run; if q steps ended exactly at now, the
        # boundary is now
        k = q if q >= 1 and t0 + q * A + g * (q - 1) * q * 0.5 >= now else q + 1
        if k >= m:
            return None
        self.run_m = k
        self.run_ver += 1
        return t0 + k * A + g * (k - 1) * k * 0.5

    def run_done(self, k: int, now: float) -> list[DecodeSession] | tuple[()]:
        """``k`` steps of the run ended at ``now`` (the whole run, or its first ``k`` steps when a
        driver stops early): returns the sessions whose round ended with them (call
        ``round_end`` for each, then ``schedule``)."""
        n = self.batch_n
        k0 = self.step_idx
        self.flush(k)
        self.busy_s += now - self.run_t0
        self.last_end = now
        self.step_idx = k0 + k
        self.ctx_sum += n * k
        self.kv_used += n * k
        # state stays STEPPING until the driver calls schedule(): work that arrives while the
        # exits are handled sees a run that has just ended (cut() then changes nothing)
        exits = self.exit_at.pop(k0 + k - 1, None)
        if not exits:
            return ()
        heapq.heappop(self.exit_heap)
        self.batch_n = n - len(exits)
        for s in exits:
            self.ctx_sum -= s.ctx_join + s.out - 1
        return exits

    def stop_early(self, s: DecodeSession, tokens: int) -> None:
        """The round of ``s`` (in the batch) ended after ``tokens`` output tokens, before its planned
        last step (EOS, a stop string, a cancellation): it leaves the batch now. Call it after
        ``run_done`` reported the step that made its last token and before the next ``schedule``;
        ``s.out`` becomes ``tokens`` (``round_end`` next). Live only: the simulator knows every
        round's length."""
        ex = s.lo + s.out - 2
        bucket = self.exit_at.get(ex)
        if bucket is None or s not in bucket:
            raise ValueError(f"{self.worker_id}: session {s.session_id!r} is not in the batch")
        bucket.remove(s)
        if not bucket:
            del self.exit_at[ex]
            self.exit_heap.remove(ex)
            heapq.heapify(self.exit_heap)
        self.batch_n -= 1
        self.ctx_sum -= s.ctx_join + (tokens - 1)  # its context after tokens - 1 steps
        s.out = tokens

    def flush(self, upto: int) -> None:
        """Steps [run_flushed, upto) of the run join the ITL window (one sample of their mean gap).
        The run's first gap of a session that was in the batch before it includes any prefill pause;
        a joining session's first gap runs from its first token."""
        a = self.run_flushed
        if upto <= a:
            return
        A, g, n, t0 = self.run_A, self.run_g, self.batch_n, self.run_t0
        gsum = 0.0
        if a == 0:
            e0 = t0 + A
            gsum = n * e0 - (n - self.step_new) * self.last_end - self.step_ft
            a = 1
        if upto > a:
            gsum += n * ((upto - a) * A + g * (a + upto - 1) * (upto - a) * 0.5)
        cnt = n * (upto - self.run_flushed)
        # WindowedMean.add inlined (a call per run of steps is a visible share of a simulation)
        t = t0 + upto * A + g * (upto - 1) * upto * 0.5
        w = self.window
        total = gsum / cnt * cnt
        smp = w._samples
        smp.append((t, total, cnt))
        w._sum += total
        w._count += cnt
        if smp[0][0] < t - w.window_s:
            w._expire(t)
        self.wadds += 1
        self.run_flushed = upto

    # ------------------------------------------------------------------------- live drivers
    def step_done(self, now: float) -> list[DecodeSession] | tuple[()]:
        """A driver that runs one step per ``schedule`` (the live service): the run's first step
        ended at ``now``, a measured time. The run becomes that one step, its ITL samples use
        ``now`` (unless a ``view`` already counted the step at its planned end), then as
        ``run_done(1, now)``."""
        self.run_m = 1
        if self.run_flushed == 0:
            self.run_A = now - self.run_t0
            self.run_g = 0.0
        return self.run_done(1, now)

    def batch(self) -> list[DecodeSession]:
        """The sessions in the batch (after ``schedule`` returned a run: the run's), for a driver
        that feeds an engine."""
        return [s for b in self.exit_at.values() for s in b]

    def drop(self, s: DecodeSession) -> bool:
        """The session ended early (cancelled, or failed outside the core: a remote prefill, a
        tool): forget it wherever it is and release the KV charged to it. A driver calls it
        between runs, never while a decode run that holds ``s`` is in progress. True when KV was
        freed (then loop on ``admit_next``)."""
        in_round = not s.in_tool  # between rounds (a tool call), round_end has charged its round
        if s.in_tool:
            s.in_tool = False
            self._not_evictable(s)  # it must not be evicted any more
        for w in (self.new_wait, self.kv_wait):
            if s in w:
                w.remove(s)
                self.wait_need -= s.l_incr
                if w is self.new_wait:
                    return False  # not admitted: nothing charged
                in_round = False  # its round was never admitted
                break
        if self.sessions.get(s.session_id) is not s:
            return False
        del self.sessions[s.session_id]
        self.live -= 1
        kv = 0 if s.evicted else s.l_hist
        ex = s.lo + s.out - 2
        if in_round:
            kv += s.l_incr
            if self.queue.discard(s.session_id, s.round):
                self.qver += 1
                self.qlen -= 1
            if self.chunk is not None and self.chunk[0] is s:
                self.chunk = None
                self.chunk_step_due = False
            if s in self.pending:
                self.pending.remove(s)
                kv += 1
            elif s in self.exit_at.get(ex, ()):
                steps = self.step_idx - s.lo
                kv += 1 + steps
                self.batch_n -= 1
                self.ctx_sum -= s.ctx_join + steps
                b = self.exit_at[ex]
                b.remove(s)
                if not b:
                    del self.exit_at[ex]
                    self.exit_heap.remove(ex)
                    heapq.heapify(self.exit_heap)
        self.kv_used -= kv
        return kv > 0

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
            if x >= self.run_A and self.run_flushed < self.run_m:
                self.flush(steps_done(x, self.run_A, self.run_g, self.run_m))
        mean = self.window_mean(now)
        free = self.kv_cap - self.kv_used - self.wait_need
        residual = self.busy_until - now if self.state == PREFILLING and self.busy_until > now else 0.0
        if self.vq_ver != self.qver:
            self.vq = self.queue.tasks()
            self.vpred = self.queue.predicted_total()
            self.vq_ver = self.qver
        pred = self.vpred + residual
        v = self.view_
        # the last view holds while everything it shows is unchanged, its predicted queue included
        # (a view cached during a local prefill must not outlive the prefill's residual time)
        if (v is not None and v.queue is self.vq and mean == self.v_mean and free == self.v_free
                and pred == v.queue_predicted_s):
            return v
        # positional: the field order of WorkerView (cheaper than keywords; a view per routing decision)
        v = WorkerView(self.worker_id, "decode", self.tp, mean, self.vq, free, pred)
        self.view_ = v
        self.v_mean = mean
        self.v_free = free
        return v
