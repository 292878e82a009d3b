"""Decode worker core: KV admission, the continuous batch, the local prefill queue, chunked local
prefill, windowed ITL and the published view.

Pure: no I/O, no clock; every call takes the time. A driver (the live decode service, the simulator)
runs what the core schedules and feeds it events, like a serving engine's scheduler:

The work cycle (when ``state == IDLE``)::

    core.schedule(now)         -> LocalPrefill | DecodeRun | None   what runs next (None: idle)
    core.update(work, now)     -> sessions                         ``work`` (what schedule returned)
                                                                   ended: a run's sessions whose
                                                                   round ended with it (``round_end``
                                                                   each), or a prefill's session
                                                                   whose prefill is complete
                                                                   (``first_token``)
    core.cut(now)              -> float | None   work arrived mid-run: end the run at the next step
                                                 boundary (its new end, or None)

Events (a round's life, between the work)::

    core.round_ready(s, now)   -> ADMITTED | WAITING | FAILED   a round's input is ready: KV admission
    core.admit_next(now)       -> DecodeSession | None   a waiting round whose KV now fits (loop on it
                                                         whenever an event says KV may have freed)
    core.submit_local(task)                              a prefill routed to this worker (its queue)
    core.first_token(s, now)   -> bool    False: the round ended with its first token
    core.round_end(s, last)               account the round's KV (release on the last)
    core.tool_call(s, pin)     -> bool    between rounds: the session waits for a tool result (or its
                                          next turn); True: it is evictable and rounds wait
    core.rewind(s, tokens)                between rounds: the history shrinks (an edit)
    core.pin_expired(s)        -> bool    a pinned session's KV may be evicted
    core.view(now)             -> WorkerView
    live only: core.take_victims() (whose KV an admission evicted), core.sync_kv_free(tokens),
    core.make_room(tokens), core.stop_early(s, tokens), core.batch(), core.drop(s)

After any call, a driver calls ``schedule`` when ``state == IDLE`` and ``cut`` when it is ``STEPPING``
and new work (a joining session, a local prefill) arrived.

Decode runs: a ``DecodeRun`` is ``steps`` decode steps with a fixed batch, step ``j`` lasting
``first_s + growth_s * j`` (the batch's context grows by ``batch`` tokens a step, and ``t_dec`` is
affine in the context). It runs up to the next exit from the batch. The simulator schedules one event
for the whole run (cut short by ``cut``); a core made with ``step_by_step`` (the live service) runs
only the plan's first step before the next ``schedule``, and ``update`` takes the step's end as
measured (a run is a plan, not a promise). A profile whose ``t_dec`` is not affine in the context
gets runs of one step.

KV admission (``kv_admission``, ``ampd.worker.decode_kv``): a round needs KV for its new input.
``"wait"``: a round whose KV does not fit waits until KV frees; the next rounds of running sessions go
before new sessions, and when every running session on the worker waits (nobody will free any), the
first goes ahead over capacity rather than deadlock (counted in ``kv_overcommits``). ``"fail"``: the
round's session fails ("KV exhausted") and releases its KV. Decode tokens are charged as they are made
(one per step per session; one for the round's first token) and never refused; with the host tier a
round reserves its whole output when it is admitted instead (``KvAdmission._round_need``).

Eviction: a session idle between rounds (in a tool call, or waiting for its client's next turn) is
*evictable* at once with ``kv_evict``, or once its KV pin expires (Continuum's TTL, ``pin_expired``).
A round whose KV does not fit first evicts evictable sessions, least recently used first (the one
whose tool call began longest ago), until it fits; only then does it wait or fail. An evicted
session's next round prefills its whole context again (``l_hist`` 0; ``kv_recomputed_tokens`` counts those
history tokens). docs/architecture.md "KV eviction" says why this victim order. With prefix
sharing an evicted session's blocks that other sessions still read stay (``DecodeSession.pinned``,
``pin_own``: ``TierMixin._unpin``).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Sequence

from ampd.policy.cost import dec_s, pre_s
from ampd.policy.reorder import PrefillQueue
from ampd.policy.types import DecodeCost, PrefillTask
from ampd.window import STATS_WINDOW_S, WindowedMean

from .decode_kv import ADMITTED, FAILED, KV_ADMISSION, KV_EXHAUSTED, WAITING, DecodeSession
from .decode_tier import HostTier
from .decode_run import (IDLE, PREFILLING, STEPPING, DecodeRun, LocalPrefill, RunWindow, affine_ctx_coef,
                         steps_done)

__all__ = ["DecodeCore", "DecodeSession", "LocalPrefill", "DecodeRun", "steps_done", "affine_ctx_coef",
           "IDLE", "STEPPING", "PREFILLING", "ADMITTED", "WAITING", "FAILED", "KV_ADMISSION", "KV_EXHAUSTED"]



class DecodeCore(RunWindow):
    """State of one decode worker (see the module docstring for the protocol).

    ``cost`` needs ``t_pre`` and ``t_dec`` (``ampd.perf.Profile``). ``chunk_tokens`` > 0 splits a
    local prefill longer than that into chunks, one decode step of the batch between two chunks.
    ``step_by_step``: every run is one step, and ``update`` takes its end as measured (a live
    driver). The run in progress is ``run`` (start ``run_t0``, first step ``run_first_s``, growth
    ``run_growth_s``, ``run_steps`` steps); ``run_ver`` changes whenever a run starts or is cut, so a
    driver can drop stale ends."""

    __slots__ = ("ctx_coef", "chunk_tokens", "step_by_step", "ctx_sum", "exit_heap", "run", "run_ver", "run_cut",
                 "busy_s", "chunk_done", "chunk_step_due")  # (and its bases', down to TierMixin's)

    def __init__(self, worker_id: str, tp: int, cost: DecodeCost, queue: PrefillQueue, *,
                 kv_capacity_tokens: int, window_s: float = STATS_WINDOW_S, chunk_tokens: int = 0,
                 kv_admission: str = "wait", kv_evict: bool = False, step_by_step: bool = False,
                 tier: HostTier | None = None):
        if kv_admission not in KV_ADMISSION:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSION)}, got {kv_admission!r}")
        self.worker_id = worker_id
        self.tp = tp
        self.cost = cost
        self.queue = queue
        self.kv_admission = kv_admission
        self.ctx_coef = affine_ctx_coef(cost, tp)  # None: runs of one step
        self.chunk_tokens = chunk_tokens
        self.step_by_step = step_by_step
        self.sessions = {}  # admitted sessions by id
        self.state = IDLE
        self.batch_size = 0
        self.ctx_sum = 0  # context tokens of the batch
        self.pending = []  # sessions with a first token, joining at the next run
        self.exit_at = {}  # global step index -> sessions ending there
        self.exit_heap: list[int] = []
        self.step_idx = 0  # global index of the next decode step
        self.last_end = 0.0  # end of the last decode step
        self.run_joined = 0  # sessions that joined at the run in progress
        self.run_joined_first = 0.0  # sum of their first-token times
        self.run: DecodeRun | None = None  # the run in progress (or the last one)
        self.run_t0 = 0.0
        self.run_first_s = 0.0
        self.run_growth_s = 0.0
        self.run_steps = 0
        self.run_ver = 0
        self.run_flushed = 0  # steps of the run already in the ITL window
        self.run_cut = False
        self.kv_cap = kv_capacity_tokens
        self.kv_used = 0
        self.admitted = 0  # admitted sessions
        self.kv_wait = deque()  # next rounds of running sessions waiting for KV
        self.new_wait = deque()  # new sessions whose first round waits for KV
        self.wait_need = 0  # KV tokens the waiting rounds need
        # sessions idle between rounds whose KV may be evicted, least recently used first (the order
        # they became evictable in); a session leaves it when its next round is ready or it ends
        self.evictable = OrderedDict()  # -> its KV tokens on the device
        self.evictable_kv = 0  # KV tokens they hold
        self.kv_evict = kv_evict  # idle sessions are evictable from the start of their tool call
        self.victims = []  # evicted by the last admission (the driver frees them)
        self.window = WindowedMean(window_s)
        self.busy_s = 0.0
        self.in_prefill = None  # the (unchunked) local prefill in service
        self.chunk_session = None  # the chunked local prefill in service
        self.chunk_done = 0  # its tokens prefilled (its chunk in service included)
        self.chunk_step_due = False  # a chunk just ended: one decode step comes next
        self.busy_until = 0.0  # predicted end of the local prefill in service (counts as queued work)
        self.kv_overcommits = 0
        self.kv_evictions = 0
        self.kv_recomputed_tokens = 0  # history tokens prefilled again after an eviction
        self.queue_ver = 0  # pushes + pops of the queue (the view's queue copy is rebuilt when it moves)
        self.queue_len = 0
        # the view's cache: the queue copy (rebuilt when queue_ver moved) and the last view
        self.view_queue_ver = -1
        self.view_queue = ()
        self.view_queue_s = 0.0  # the copied queue's predicted total
        self.last_view = None
        # views carry a copy of the queued tasks (WorkerView.queue); a driver whose readers use only
        # queue_predicted_s (the simulator) sets False and views carry ()
        self.view_tasks = True
        self.tier = tier  # the host KV tier (ampd.worker.decode_tier); None: off

    # -------------------------------------------------------------------------- local prefills
    def submit_local(self, task: PrefillTask) -> None:
        """A prefill routed to this worker joins its local queue."""
        self.queue.push(task)
        self.queue_ver += 1
        self.queue_len += 1

    def _chunk(self, s: DecodeSession, now: float) -> LocalPrefill:
        """The next chunk of ``s`` (``chunk_session``)."""
        done = self.chunk_done
        n = min(self.chunk_tokens, s.l_incr - done)
        dur = pre_s(self.cost, self.tp, s.l_hist + done, n)
        self.chunk_done = done + n
        self.chunk_step_due = True
        self.state = PREFILLING
        self.busy_until = now + dur
        self.busy_s += dur
        return LocalPrefill(s, n, dur, now + dur, done + n >= s.l_incr)

    def _prefill_done(self) -> tuple[DecodeSession] | tuple[()]:
        """The local prefill or chunk in service ended; the session whose prefill is complete is
        returned (its first token is now: call ``first_token``)."""
        self.state = IDLE
        s = self.chunk_session
        if s is not None:
            if self.chunk_done >= s.l_incr:
                self.chunk_session = None
                self.chunk_step_due = False
                return (s,)
            return ()
        s = self.in_prefill
        self.in_prefill = None
        return (s,) if s is not None else ()

    # ------------------------------------------------------------------------------- schedule
    def schedule(self, now: float) -> LocalPrefill | DecodeRun | None:
        """When idle: the next thing to run. A chunked prefill alternates with one decode step of
        the batch; else a queued local prefill (Algorithm 2's pick) goes before decoding
        (prefill-priority); else a run of decode steps up to the next exit; else None (idle)."""
        chunk = self.chunk_session
        if chunk is not None and not (self.chunk_step_due and (self.batch_size or self.pending)):
            return self._chunk(chunk, now)
        if self.queue_len and chunk is None:
            task = self.queue.pop(now)
            self.queue_ver += 1
            self.queue_len -= 1
            s = self.sessions[task.session_id]
            if self.chunk_tokens and task.l_incr > self.chunk_tokens:
                self.chunk_session = s
                self.chunk_done = 0
                return self._chunk(s, now)
            dur = pre_s(self.cost, self.tp, task.l_hist, task.l_incr)
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
            self.run_joined = len(pend)
            self.run_joined_first = ft
            self.batch_size += len(pend)
            pend.clear()
        else:
            self.run_joined = 0
            self.run_joined_first = 0.0
        n = self.batch_size
        if not n:
            self.state = IDLE
            return None
        A = dec_s(self.cost, self.tp, n, self.ctx_sum)
        coef = self.ctx_coef
        if coef is None or self.chunk_session is not None:  # one step between two prefill chunks
            m = 1
            g = 0.0 if coef is None else coef * n
            self.chunk_step_due = False
        else:
            # a run of steps up to the next exit from the batch (cut short when a session joins or
            # a local prefill arrives: see cut())
            m = self.exit_heap[0] - self.step_idx + 1
            g = coef * n
        self.state = STEPPING
        self.run_t0 = now
        self.run_first_s = A
        self.run_growth_s = g
        # step_by_step: the plan holds, but one step runs before the next schedule (views count no
        # step not run)
        self.run_steps = 1 if self.step_by_step else m
        self.run_flushed = 0
        self.run_cut = self.step_by_step
        self.run_ver += 1
        # positional, in DecodeRun's field order (steps, first_s, growth_s, batch, end): a keyword
        # call costs more, and a run is built per run of steps
        run = self.run = DecodeRun(m, A, g, n, now + m * A + g * m * (m - 1) * 0.5)
        return run

    def update(self, work: LocalPrefill | DecodeRun, now: float) -> Sequence[DecodeSession]:
        """``work`` (what ``schedule`` returned) ended at ``now``: a run (its steps, up to where
        ``cut`` ended it; with ``step_by_step`` its one step, ``now`` measured), or a local prefill or
        chunk. Returns the sessions it ended: a run's sessions whose round ended with it (call
        ``round_end`` for each), or the session whose prefill is complete (its first token is now:
        call ``first_token``). Then ``schedule``."""
        if type(work) is DecodeRun:
            if self.step_by_step:
                return self._step_measured(now)
            return self._run_done(self.run_steps, now)
        return self._prefill_done()

    def cut(self, now: float) -> float | None:
        """Something for this worker arrived mid-run: end the run at the next step boundary.
        Returns the run's new end (its ``run_ver`` changed), or None when it ends there anyway."""
        if self.run_cut:
            return None
        self.run_cut = True
        A, g, m, t0 = self.run_first_s, self.run_growth_s, self.run_steps, self.run_t0
        q = steps_done(now - t0, A, g, m)
        # the step in progress (index q) ends the run; if q steps ended exactly at now, the
        # boundary is now
        k = q if q >= 1 and t0 + q * A + g * (q - 1) * q * 0.5 >= now else q + 1
        if k >= m:
            return None
        self.run_steps = k
        self.run_ver += 1
        return t0 + k * A + g * (k - 1) * k * 0.5

    def _run_done(self, k: int, now: float) -> list[DecodeSession] | tuple[()]:
        """``k`` steps of the run ended at ``now``: the sessions whose round ended with them."""
        n = self.batch_size
        k0 = self.step_idx
        self._flush(k)
        self.busy_s += now - self.run_t0
        self.last_end = now
        self.step_idx = k0 + k
        self.ctx_sum += n * k
        if self.tier is None:
            self.kv_used += n * k
        # state stays STEPPING until the driver calls schedule(): work that arrives while the
        # exits are handled sees a run that has just ended (cut() then changes nothing)
        exits = self.exit_at.pop(k0 + k - 1, None)
        if not exits:
            return ()
        heapq.heappop(self.exit_heap)
        self.batch_size = n - len(exits)
        for s in exits:
            self.ctx_sum -= s.ctx_join + s.out - 1
        return exits

    def stop_early(self, s: DecodeSession, tokens: int) -> None:
        """The round of ``s`` (in the batch) ended after ``tokens`` output tokens, before its planned
        last step (EOS, a stop string, a cancellation): it leaves the batch now. Call it after
        ``update`` reported the step that made its last token and before the next ``schedule``;
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
        self.batch_size -= 1
        self.ctx_sum -= s.ctx_join + (tokens - 1)  # its context after tokens - 1 steps
        if self.tier is not None:  # the output reserved beyond its last token frees
            self.kv_used -= s.out - tokens
            s.due = 0
        s.out = tokens

    def _step_measured(self, now: float) -> list[DecodeSession] | tuple[()]:
        """``step_by_step``: the run's one step ended at ``now``, a measured time. Its ITL samples
        use ``now`` (unless a ``view`` already counted the step at its planned end)."""
        self.run_steps = 1
        if self.run_flushed == 0:
            self.run_first_s = now - self.run_t0
            self.run_growth_s = 0.0
        return self._run_done(1, now)

    # ------------------------------------------------------------------------- live drivers

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
                self.wait_need -= self._round_need(s)
                if w is self.new_wait:
                    return False  # not admitted: nothing charged
                in_round = False  # its round was never admitted
                break
        if self.sessions.get(s.session_id) is not s:
            return False
        del self.sessions[s.session_id]
        self.admitted -= 1
        kv = 0 if s.evicted else s.l_hist - s.fetch - s.shared  # (s.shared: not charged yet)
        self.tier_release(s)
        ex = s.lo + s.out - 2
        if in_round:
            kv += s.l_incr
            if self.queue.discard(s.session_id, s.round):
                self.queue_ver += 1
                self.queue_len -= 1
            if self.chunk_session is s:
                self.chunk_session = None
                self.chunk_step_due = False
            if s in self.pending:
                self.pending.remove(s)
                kv += 1
            elif s in self.exit_at.get(ex, ()):
                steps = self.step_idx - s.lo
                kv += 1 + steps
                self.batch_size -= 1
                self.ctx_sum -= s.ctx_join + steps
                b = self.exit_at[ex]
                b.remove(s)
                if not b:
                    del self.exit_at[ex]
                    self.exit_heap.remove(ex)
                    heapq.heapify(self.exit_heap)
            if self.tier is not None:  # its round's whole output was reserved at admission
                kv = (0 if s.evicted else s.l_hist - s.fetch - s.shared) + s.l_incr + s.out
                s.due = 0
        self.kv_used -= kv
        return kv > 0
