"""The event loop: the worker cores (``ampd.worker``) and the policy cores (``ampd.policy``) driven
on a virtual clock.

Every decode worker is a ``DecodeCore`` and every prefill worker a ``PrefillCore``, the same cores
the live services drive; this module only turns what they say into timed events and back. It adds
what only a simulation has: the sessions' scripted rounds and tool calls, the control path's
latencies (``PathLatency``), NIC contention between KV transfers, and the step logs that keep every
token time in closed form (``ampd.sim.steplog``). docs/simulator.md explains the model.

Hot path (100k GAIA sessions on 32 GPUs in well under a minute on one core): one heap event per run
of decode steps, never per step or token; heap entries are plain tuples ``(time, seq, code, obj)``
(``seq`` breaks ties in push order); handlers are methods of one slotted object.
"""
from __future__ import annotations

from heapq import heappop, heappush
import math
import time as _time
from typing import Sequence

from ampd.policy import SLO, PrefillTask, WorkerView, in_worker_order, make_queue, make_router, policy_spec
from ampd.policy.admit import AdmissionBook
from ampd.worker import (ADMITTED, FAILED, IDLE, STEPPING, DecodeCore, DecodeRun, DecodeSession, KvRead, LocalPrefill,
                         PrefillCore, PrefillWork)

from .config import PathLatency, SimConfig
from .gcpause import gc_paused
from .result import SimResult, SimRound, SimSession
from ampd.deployment import expand_spec, format_spec, parse_spec
from .steplog import StepLog

__all__ = ["Simulator", "simulate"]

# event codes (ints: cheap to compare in the dispatch loop)
_STEP_DONE = 0  # a run of decode steps ended (obj: (worker, run version))
_PREFILL_DONE = 1  # a local prefill or one of its chunks ended
_REMOTE_DONE = 2  # a remote prefill's new KV is written back
_COMPUTE_DONE = 3  # a remote prefill's compute ended (NIC contention: its write-back queues next)
_ROUND_READY = 4  # a round's input is ready at its decode worker
_PIN_EXPIRED = 5  # a session's KV pin expired during its tool call (Continuum)
_DISPATCH = 7  # a round reaches the coordinator and is routed (after PathLatency.dispatch_s)
_HANDOFF = 8  # a remote prefill's KV notification reaches the decode worker
_COMPUTE_START = 9  # a remote prefill's history read ended: its compute starts (KV overlap)
_ADMIT_CHECK = 10  # a session waiting for admission is judged again (its wait or TTFT budget ends)

# SimRound(...) without its Python-level __new__ (a named tuple): one C call per round
_new_round = tuple.__new__

# How often the head of the admission queue looks again without a release (the coordinator's
# poll, services/coordinator/admission.py); only the slo rule's verdict can change meanwhile.
_HEAD_POLL_S = 0.5


class _Decode(DecodeCore):
    """A decode worker in the simulator: the core plus its step log and NIC."""

    __slots__ = ("idx", "log", "nic", "log_row")

    def __init__(self, idx: int, *args, **kw):
        super().__init__(*args, **kw)
        self.idx = idx
        lg = self.log = StepLog()
        self.nic = 0.0  # when its NIC is free (kv_contention)
        # the step log's row append, bound once (step_done runs per run of steps)
        self.log_row = lg.rows.extend


class _Prefill(PrefillCore):
    """A prefill worker in the simulator: the core plus its NIC and busy time."""

    __slots__ = ("nic", "cs_event", "busy_s")

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.nic = 0.0
        self.busy_s = 0.0  # the simulator knows the real durations (NIC contention, PathLatency)
        self.cs_event = False  # a _COMPUTE_START event is scheduled for the task in service


class _Views:
    """The prefill workers' views for one routing decision, each built on first read. Algorithm 1
    stops at the first prefill worker with slack (most decisions), so most views are never read;
    the router is pure and nothing changes while it runs, so a view built late equals one built
    up front. ``settle`` then reads the windowed mean of every worker whose view was not built:
    that read expires old samples, and the window's float sum depends on when they leave, so every
    worker's window moves exactly as when every view was built."""

    __slots__ = ("ps", "now", "vs", "blank")

    def __init__(self, ps: list, now: float):
        self.ps = ps
        self.now = now
        self.blank = [None] * len(ps)
        self.vs = self.blank[:]

    def reset(self, now: float) -> None:
        """Ready for the next routing decision (one object per run, reset per decision)."""
        self.now = now
        self.vs = self.blank[:]

    def __len__(self) -> int:
        return len(self.ps)

    def __getitem__(self, i: int):
        v = self.vs[i]
        if v is None:
            v = self.vs[i] = self.ps[i].view(self.now)
        return v

    def __iter__(self):
        for i in range(len(self.ps)):
            yield self[i]

    def settle(self) -> None:
        vs, now = self.vs, self.now
        for i, p in enumerate(self.ps):
            if vs[i] is None:
                p.window.mean(now)


class _Waiting:
    """A new session that admission has not bound yet (its ticket in the ``AdmissionBook``)."""

    __slots__ = ("s", "rec", "need", "at", "check_at", "done")

    def __init__(self, s, rec: SimSession, need: int, at: float):
        self.s = s
        self.rec = rec
        self.need = need
        self.at = at  # arrival: what its wait and its first round's TTFT count from
        self.check_at = math.inf  # the earliest _ADMIT_CHECK pending for it
        self.done = False


class _Sess(DecodeSession):
    """A session on its decode worker, plus its script (rounds), where its record goes and the KV
    admission promised it."""

    __slots__ = ("rounds", "rec", "dw", "ready", "local", "pw", "pwork", "write_s", "target", "need")

    def __init__(self, sid: str, rounds, rec: SimSession, dw: _Decode, need: int):
        super().__init__(sid)
        self.rounds = rounds
        self.rec = rec
        self.dw = dw
        self.need = need
        self.ready = 0.0  # the current round's input-ready time
        self.local = False
        self.pw: _Prefill | None = None  # the prefill worker running its remote prefill
        self.pwork: PrefillWork | None = None  # ... and what it runs
        self.write_s = 0.0
        self.target = ""


class _SlowerSteps:
    """The profile as the simulated decode workers run it: every decode step ``step_s`` longer
    (PathLatency.step_s). The router and the queues keep the profile itself, as live."""

    __slots__ = ("_profile", "_step_s")

    def __init__(self, profile, step_s: float) -> None:
        self._profile = profile
        self._step_s = step_s

    def t_dec(self, tp: int, batch: int, context_tokens: int) -> float:
        t = self._profile.t_dec(tp, batch, context_tokens)
        return t + self._step_s if batch > 0 else t

    def __getattr__(self, name: str):
        return getattr(self._profile, name)


class Simulator:
    """A deployment (workers, router, queues) built from a ``SimConfig``; ``run`` simulates a trace."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        prof = cfg.profile
        self.profile = prof
        spec = policy_spec(cfg.policy)
        self.spec = spec
        self.kv_pin_ttl_s = spec.kv_pin_ttl_s
        pre_groups = parse_spec(cfg.prefill) if isinstance(cfg.prefill, (str, type(None))) else tuple(cfg.prefill)
        dec_groups = parse_spec(cfg.decode) if isinstance(cfg.decode, (str, type(None))) else tuple(cfg.decode)
        if not dec_groups:
            raise ValueError("the deployment needs at least one decode worker")
        if not spec.uses_prefill_workers and pre_groups:
            raise ValueError(f"policy {cfg.policy!r} is co-located: it takes no prefill workers "
                             f"(got --prefill {format_spec(pre_groups)})")
        tps = set(prof.tps)
        for tp, _ in (*pre_groups, *dec_groups):
            if tp not in tps:
                raise ValueError(f"TP {tp} is not in profile {prof.name!r} (it covers {sorted(tps)})")
        if cfg.reorder_window < 1:
            raise ValueError(f"reorder_window must be >= 1, got {cfg.reorder_window!r}")
        self.prefill_spec = format_spec(pre_groups)
        self.decode_spec = format_spec(dec_groups)
        slo = SLO(ttft_s=cfg.ttft_slo_s, itl_s=cfg.itl_slo_s)
        self.slo = slo
        self.router = make_router(cfg.policy, prof, slo, seed=cfg.seed, **cfg.router_options)
        w, rw = cfg.window_s, cfg.reorder_window
        step_s = cfg.path.step_s if cfg.path else 0.0
        dprof = _SlowerSteps(prof, step_s) if step_s else prof
        self.decodes = [
            _Decode(i, f"decode-{i}", tp, dprof, make_queue(spec.decode_queue, prof, slo, tp, window=rw),
                    kv_capacity_tokens=int(prof.kv_capacity_tokens(tp)), window_s=w,
                    chunk_tokens=int(prof.prefill_chunk_tokens(tp)) if cfg.chunked_prefill else 0,
                    kv_admission=cfg.kv_admission, kv_evict=cfg.kv_evict)
            for i, tp in enumerate(expand_spec(dec_groups))
        ]
        # the coordinator's order (ampd.policy.order): Algorithm 1's seeded visits and every tie agree
        self.prefills = in_worker_order([
            _Prefill(f"prefill-{i}", tp, prof, make_queue(spec.prefill_queue or "fcfs", prof, slo, tp, window=rw),
                     window_s=w, kv_overlap=cfg.kv_overlap, kv_capacity_tokens=int(prof.kv_capacity_tokens(tp)))
            for i, tp in enumerate(expand_spec(pre_groups))
        ])
        self.by_id = {d.worker_id: d for d in self.decodes}
        self.by_id.update({p.worker_id: p for p in self.prefills})
        self.gpus = sum(tp * r for tp, r in (*pre_groups, *dec_groups))
        AdmissionBook(cfg.admission, cfg.admission_wait, cfg.admission_queue, prof, slo)  # checks the rule

    def run(self, sessions: Sequence) -> SimResult:
        with gc_paused():
            return _Run(self).go(sessions)


class _Run:
    """One simulation run: the event heap, the sessions in flight and the handlers."""

    __slots__ = ("sim", "heap", "seq", "live", "outcomes", "reasons", "n_local", "n_remote", "n_failed",
                 "book", "block_tokens", "refused", "n_waited",
                 "decodes", "prefills", "by_id", "router", "pviews_static", "pviews", "route_fn", "pin_ttl", "kv_evict", "open_s", "dispatch_s",
                 "handoff_s", "tool_rpc_s", "busy_extra", "contention", "dispatch")

    def __init__(self, sim: Simulator):
        cfg = sim.cfg
        self.sim = sim
        self.heap: list = []
        self.seq = 0
        self.live: dict[str, _Sess] = {}
        self.outcomes: list[SimSession] = []
        self.reasons: dict[str, int] = {}
        self.n_local = self.n_remote = self.n_failed = 0
        self.book = AdmissionBook(cfg.admission, cfg.admission_wait, cfg.admission_queue, sim.profile, sim.slo)
        self.block_tokens = cfg.block_tokens
        self.refused: dict[str, int] = {}  # admission's refusals by reason
        self.n_waited = 0  # sessions that waited for admission
        self.decodes = sim.decodes
        self.prefills = sim.prefills
        self.by_id = sim.by_id
        self.router = sim.router
        self.pviews_static = not sim.prefills
        self.pviews = _Views(sim.prefills, 0.0)
        self.route_fn = sim.router.route
        self.pin_ttl = sim.kv_pin_ttl_s
        self.kv_evict = cfg.kv_evict
        path = cfg.path or PathLatency()
        self.open_s, self.dispatch_s, self.handoff_s = path.open_s, path.dispatch_s, path.handoff_s
        self.tool_rpc_s, self.busy_extra = path.tool_s, path.prefill_busy_s
        self.contention = cfg.kv_contention
        self.dispatch = self.route if not (self.open_s or self.dispatch_s) else self.dispatch_later

    def push(self, t: float, code: int, obj) -> None:
        self.seq += 1
        heappush(self.heap, (t, self.seq, code, obj))

    # ------------------------------------------------------------------------------- the loop
    def go(self, sessions: Sequence) -> SimResult:
        wall0 = _time.perf_counter()
        order = sorted(range(len(sessions)), key=lambda i: (sessions[i].arrival, i))
        ids_seen: set = set()
        heap = self.heap
        pop = heappop
        n_events = 0
        ai = 0
        na = len(order)
        next_arr = float(sessions[order[0]].arrival) if na else math.inf
        now = 0.0
        # handlers bound once (a paper-scale run dispatches ~5M events)
        step_done, prefill_done, remote_done = self.step_done, self.prefill_done, self.remote_done
        round_ready, route, first_token, arrive = self.round_ready, self.route, self.first_token, self.arrive
        while True:
            if heap and heap[0][0] <= next_arr:
                now, _, code, obj = pop(heap)
            elif ai < na:
                now = next_arr
                arrive(sessions[order[ai]], now, ids_seen)
                ai += 1
                next_arr = float(sessions[order[ai]].arrival) if ai < na else math.inf
                n_events += 1
                continue
            else:
                break
            n_events += 1
            if code == _STEP_DONE:
                if obj[1] == obj[0].run_ver:  # else a run that was cut short (~0.6 a round)
                    step_done(obj, now)
            elif code == _REMOTE_DONE:
                remote_done(obj, now)
            elif code == _ROUND_READY:
                round_ready(obj, now)
            elif code == _PREFILL_DONE:
                prefill_done(obj, now)
            elif code == _DISPATCH:
                route(obj, now)
            elif code == _HANDOFF:
                first_token(obj, now)
            elif code == _PIN_EXPIRED:
                d = obj.dw
                if d.pin_expired(obj):
                    self.drain(d, now)
            elif code == _COMPUTE_START:
                self.compute_start(obj, now)
            elif code == _COMPUTE_DONE:
                self.compute_done(obj, now)
            elif code == _ADMIT_CHECK:
                if not obj.done:
                    obj.check_at = math.inf
                    self.admit(obj, now)
        return self.result(now, n_events, _time.perf_counter() - wall0, len(sessions))

    # --------------------------------------------------------------------- sessions and rounds
    def arrive(self, s, now: float, ids_seen: set) -> None:
        sid = str(s.id)
        if sid in ids_seen:
            raise ValueError(f"duplicate session id {sid!r} in the trace")
        ids_seen.add(sid)
        rec = SimSession(sid, float(s.arrival), "")
        self.outcomes.append(rec)
        if not s.rounds:
            rec.completed = True
            rec.end = now
            return
        # what the coordinator promises a replayed session: its whole script (services/coordinator
        # core.turn_kv_tokens) and a partly filled last block
        need = sum(int(r.input) + int(r.output) for r in s.rounds) + self.block_tokens
        self.admit(_Waiting(s, rec, need, now), now)

    # ------------------------------------------------------------------------------- admission
    def admit(self, w: _Waiting, now: float) -> None:
        """Judge ``w`` (ampd.policy.admit.AdmissionBook, the coordinator's core): bind it, refuse it,
        or let it wait (judged again when KV is released, at the end of its wait, or, as the head
        under the slo rule, every _HEAD_POLL_S)."""
        book = self.book
        queued = w in book.waiting
        decode = []
        for d in self.decodes:  # every worker's view, as the coordinator reads them (windows move)
            v = d.view(now)
            decode.append(WorkerView(worker_id=v.worker_id, kind="decode", tp=v.tp, window_mean_s=v.window_mean_s,
                                     queue=v.queue, kv_free_tokens=d.kv_cap, queue_predicted_s=v.queue_predicted_s))
        prefills = [p.view(now) for p in self.prefills] if book.rule == "slo" else ()
        v = book.judge(w, w.need, int(w.s.rounds[0].input), now - w.at, decode, prefills)
        if v.worker is None and not v.reason:
            if not queued:
                self.n_waited += 1
            at = now + (min(v.wait_s, _HEAD_POLL_S) if book.rule == "slo" and book.head is w else v.wait_s)
            if at <= now:  # a wait shorter than the clock's resolution: the next instant
                at = math.nextafter(now, math.inf)
            if at < w.check_at:
                w.check_at = at
                self.push(at, _ADMIT_CHECK, w)
            return
        w.done = True
        head_left = book.leave(w)
        rec = w.rec
        if v.reason:
            self.refused[v.reason] = self.refused.get(v.reason, 0) + 1
            rec.error = f"admission: {v.reason}: {v.detail}"
            rec.end = now
        else:
            d = self.by_id[v.worker]
            rec.decode_worker = d.worker_id
            st = _Sess(rec.session_id, w.s.rounds, rec, d, w.need)
            self.live[rec.session_id] = st
            self.round_ready(st, now, w.at)
        if head_left:
            self.admit_head(now)

    def admit_head(self, now: float) -> None:
        """KV was released or the head left: the new head is judged (and so on while they pass)."""
        w = self.book.head
        if w is not None:
            self.admit(w, now)

    def release(self, st: _Sess, now: float) -> None:
        """The session ended: its promise frees, for the sessions waiting."""
        self.book.release(st.dw.worker_id, st.need)
        self.admit_head(now)

    def round_ready(self, st: _Sess, now: float, ready: float = -1.0) -> None:
        """The round's input is ready at ``ready`` (default ``now``; a first round: the arrival)."""
        rnd = st.rounds[st.round]
        st.ready = now if ready < 0.0 else ready
        st.l_incr = int(rnd.input)
        st.out = int(rnd.output)
        d = st.dw
        code = d.round_ready(st, now)
        if code == ADMITTED:
            self.dispatch(st, now)
        elif code == FAILED:
            self.n_failed += 1
            rec = st.rec
            rec.error = st.error
            rec.end = now
            del self.live[st.session_id]
            self.release(st, now)
        else:
            self.drain(d, now)

    def drain(self, d: _Decode, now: float) -> None:
        """Route every waiting round whose KV now fits."""
        while True:
            st = d.admit_next(now)
            if st is None:
                return
            self.dispatch(st, now)

    def round_end(self, st: _Sess, now: float, last: float) -> None:
        d = st.dw
        out = st.out
        st.rec.rounds.append(_new_round(SimRound, (st.round, st.ready, st.first, last, out, st.local, d.idx,
                                                   st.lo if out > 1 else 0, st.target)))
        rounds = st.rounds
        final = st.round + 1 >= len(rounds)
        d.round_end(st, final)
        if not final:
            tool = rounds[st.round].tool_s
            tool = (tool if tool and tool > 0 else 0.0) + self.tool_rpc_s
            st.round += 1
            self.seq += 1
            heappush(self.heap, (now + tool, self.seq, _ROUND_READY, st))
            if self.pin_ttl is not None:
                if tool > self.pin_ttl:  # the policy pins the KV for its TTL (kv_evict or not)
                    d.tool_call(st, pin=True)
                    self.push(now + self.pin_ttl, _PIN_EXPIRED, st)
            elif self.kv_evict and d.tool_call(st):
                self.drain(d, now)
        else:
            st.rec.completed = True
            st.rec.end = now
            del self.live[st.session_id]
            self.drain(d, now)
            self.release(st, now)

    def first_token(self, st: _Sess, now: float) -> None:
        d = st.dw
        if not d.first_token(st, now):
            self.round_end(st, now, now)
        elif d.state == IDLE:
            self.decode_next(d, now)
        elif d.state == STEPPING:
            self.interrupt(d, now)

    # --------------------------------------------------------------------------------- routing
    def dispatch_later(self, st: _Sess, now: float) -> None:
        """Route the round once the control path has carried it (PathLatency)."""
        delay = self.dispatch_s + self.open_s if st.round == 0 else self.dispatch_s
        if delay:
            self.push(now + delay, _DISPATCH, st)
        else:
            self.route(st, now)

    def route(self, st: _Sess, now: float) -> None:
        d = st.dw
        task = PrefillTask(st.session_id, st.round, st.l_hist, st.l_incr, st.ready, d.worker_id, d.tp)
        dview = d.view(now)
        if self.pviews_static:
            dec = self.router.route(task, dview, (), now)
        else:
            pviews = self.pviews
            pviews.reset(now)
            dec = self.route_fn(task, dview, pviews, now)
            pviews.settle()
        reasons = self.reasons
        reasons[dec.reason] = reasons.get(dec.reason, 0) + 1
        if dec.local or dec.target == d.worker_id:
            st.local = True
            st.target = d.worker_id
            self.n_local += 1
            d.submit_local(task)
            if d.state == IDLE:
                self.decode_next(d, now)
            elif d.state == STEPPING:
                self.interrupt(d, now)
            return
        p = self.by_id.get(dec.target)
        if not isinstance(p, _Prefill):
            raise RuntimeError(f"router {self.sim.cfg.policy!r} chose unknown prefill worker {dec.target!r}")
        st.local = False
        st.target = p.worker_id
        self.n_remote += 1
        r = p.submit(task, now)
        if r is not None:
            self.read_ahead(p, r, now)
        elif p.kv_overlap and p.current is not None and not p.cs_event and now < p.compute_at:
            self.push(p.compute_at, _COMPUTE_START, (p, p.current))  # queued during a read
            p.cs_event = True
        self.prefill_next(p, now)

    # --------------------------------------------------------------------------- decode workers
    def decode_next(self, d: _Decode, now: float) -> None:
        act = d.schedule(now)
        if act is None:
            return
        self.seq += 1
        if type(act) is DecodeRun:
            heappush(self.heap, (act.end, self.seq, _STEP_DONE, (d, d.run_ver)))
        else:
            heappush(self.heap, (act.end, self.seq, _PREFILL_DONE, act))

    def interrupt(self, d: _Decode, now: float) -> None:
        """Something for this worker arrived mid-run: end the run at the next step boundary."""
        end = d.cut(now)
        if end is not None:
            self.push(end, _STEP_DONE, (d, d.run_ver))

    def step_done(self, obj, now: float) -> None:
        d = obj[0]  # the loop dropped the runs that were cut short
        n = d.batch_size
        # one row per run of steps (StepLog.FIELDS order)
        d.log_row((d.step_idx, d.run_t0, d.run_first_s, d.run_growth_s, d.run_steps, n, n - d.run_joined,
                   d.last_end))
        exits = d.update(d.run, now)
        if exits:
            round_end = self.round_end
            for st in exits:
                round_end(st, now, now)
        act = d.schedule(now)  # decode_next, inlined: once per run of steps
        if act is not None:
            self.seq += 1
            if type(act) is DecodeRun:
                heappush(self.heap, (act.end, self.seq, _STEP_DONE, (d, d.run_ver)))
            else:
                heappush(self.heap, (act.end, self.seq, _PREFILL_DONE, act))

    def prefill_done(self, work: LocalPrefill, now: float) -> None:
        d = work.session.dw
        for st in d.update(work, now):
            self.first_token(st, now)
        if d.state == IDLE:
            self.decode_next(d, now)

    # -------------------------------------------------------------------------- prefill workers
    def prefill_next(self, p: _Prefill, now: float) -> None:
        if p.current is not None or (not p.queue_len and p.ahead is None):
            return
        w = p.schedule(now)
        st = self.live[w.task.session_id]
        d = st.dw
        st.pw = p
        st.pwork = w
        st.write_s = w.write_s
        extra = self.busy_extra
        if p.kv_overlap:
            if self.contention and w.read_s and not w.was_ahead:
                start = max(now, d.nic, p.nic)
                rend = start + w.read_s
                d.nic = p.nic = rend
            else:
                rend = now + w.read_s
            p.replan(rend, rend + w.compute_s + w.write_s)
            p.busy_s += rend - now
            # the task computes right after its read, then writes back (over the NICs under contention)
            if self.contention:
                p.busy_s += w.compute_s + extra
                self.push(rend + w.compute_s + extra, _COMPUTE_DONE, st)
            else:
                p.busy_s += w.compute_s + w.write_s + extra
                self.push(rend + w.compute_s + w.write_s + extra, _REMOTE_DONE, st)
            p.cs_event = False
            if rend <= now:
                self.compute_start((p, w.task), now)
            elif p.queue_len:  # a queued task's read starts when this one computes
                self.push(rend, _COMPUTE_START, (p, w.task))
                p.cs_event = True
        elif self.contention:
            if w.task.l_hist > 0:
                start = max(now, d.nic, p.nic)
                rend = start + w.read_s
                d.nic = p.nic = rend
            else:
                rend = now
            p.replan(p.compute_at, rend + w.compute_s + w.write_s)
            p.busy_s += rend - now + w.compute_s + extra
            self.push(rend + w.compute_s + extra, _COMPUTE_DONE, st)
        else:
            dur = w.total_s
            p.busy_s += dur + extra
            self.seq += 1
            heappush(self.heap, (now + dur + extra, self.seq, _REMOTE_DONE, st))

    def read_ahead(self, p: _Prefill, r: KvRead, now: float) -> None:
        """KV overlap: the next task's history read starts now (sharing NICs under contention)."""
        if self.contention and r.task.l_hist:
            d = self.live[r.task.session_id].dw
            end = max(now, d.nic, p.nic) + r.seconds
            p.read_ahead_until(end)
            d.nic = p.nic = end

    def compute_start(self, obj, now: float) -> None:
        """KV overlap: the task in service has its history and computes; the next task leaves the
        queue and its read starts. Only scheduled while a task waits in the queue (an event per
        remote prefill would cost ~10 % of a paper-scale run for nothing)."""
        p, task = obj
        if p.current is not task:
            return  # that task already ended (zero compute and write-back)
        r = p.compute_started(now)
        if r is not None:
            self.read_ahead(p, r, now)

    def compute_done(self, st: _Sess, now: float) -> None:
        """NIC contention: the new KV's write-back waits for both workers' NICs."""
        p = st.pw
        d = st.dw
        start = max(now, d.nic, p.nic)
        end = start + st.write_s
        d.nic = p.nic = end
        p.busy_s += end - now
        self.push(end, _REMOTE_DONE, st)

    def remote_done(self, st: _Sess, now: float) -> None:
        p = st.pw
        st.pw = None
        p.update(st.pwork, now)
        st.pwork = None
        if self.handoff_s:
            self.push(now + self.handoff_s, _HANDOFF, st)
        else:
            self.first_token(st, now)
        self.prefill_next(p, now)

    # ---------------------------------------------------------------------------------- result
    def result(self, now: float, n_events: int, wall: float, n_sessions: int) -> SimResult:
        sim = self.sim
        decodes, prefills = self.decodes, self.prefills
        for d in decodes:
            d.log.finish()
        for st in self.live.values():
            st.rec.completed = False
        for w in self.book.waiting:
            w.rec.error = "waiting for admission at the end of the simulation"
        stats = {
            "events": n_events,
            "wall_s": wall,
            "sessions_per_s": (n_sessions / wall) if wall > 0 else math.inf,
            "sim_end_s": now,
            "local_prefills": self.n_local,
            "remote_prefills": self.n_remote,
            "route_reasons": self.reasons,
            "kv_overcommits": sum(d.kv_overcommits for d in decodes),
            "kv_evictions": sum(d.kv_evictions for d in decodes),
            "unfinished_sessions": len(self.live) + len(self.book.waiting),
            "admission_refused": self.refused,
            "admission_waited": self.n_waited,
            "decode_steps": [d.step_idx for d in decodes],
            "decode_busy_fraction": [d.busy_s / now if now > 0 else 0.0 for d in decodes],
            "prefill_busy_fraction": [p.busy_s / now if now > 0 else 0.0 for p in prefills],
            "kv_used_end": [d.kv_used for d in decodes],
            # the queues' pops (ampd.policy.reorder): with a choice (>= 2 queued), reordered, and
            # (Algorithm 2's queues) with a choice where FCFS already met every window task
            "pops": {kind: {"choice": sum(w.queue.pops_choice for w in ws),
                            "reordered": sum(w.queue.pops_reordered for w in ws),
                            "on_time": sum(getattr(w.queue, "pops_on_time", 0) for w in ws)}
                     for kind, ws in (("prefill", prefills), ("local", decodes))},
            "gpus": sim.gpus,
            "prefill_spec": sim.prefill_spec,
            "decode_spec": sim.decode_spec,
        }
        if sim.cfg.kv_admission == "fail":
            stats["kv_failed_sessions"] = self.n_failed
        if sim.cfg.kv_evict:
            stats["kv_recomputed_tokens"] = sum(d.kv_recomputed_tokens for d in decodes)
        return SimResult(sim.cfg.policy, self.outcomes, [d.log for d in decodes], now, stats,
                         [d.worker_id for d in decodes])


def simulate(sessions, profile, *, policy: str, prefill="none", decode="tp1*1",
             ttft_slo_s: float = 1.0, itl_slo_s: float = 0.1, seed: int = 0, window_s: float = 10.0,
             kv_contention: bool = False, reorder_window: int = 3, chunked_prefill: bool = False,
             kv_admission: str = "wait", kv_evict: bool = False, kv_overlap: bool = True,
             path: PathLatency | None = None, admission: str = SimConfig.admission,
             admission_wait: float = SimConfig.admission_wait, admission_queue: int = SimConfig.admission_queue,
             block_tokens: int = SimConfig.block_tokens, **router_options) -> SimResult:
    """Run ``sessions`` (``ampd.workload.Session``s) on a deployment; see ``SimConfig``."""
    cfg = SimConfig(profile=profile, policy=policy, prefill=prefill, decode=decode,
                    ttft_slo_s=ttft_slo_s, itl_slo_s=itl_slo_s, seed=seed, window_s=window_s,
                    kv_contention=kv_contention, reorder_window=reorder_window,
                    chunked_prefill=chunked_prefill, kv_admission=kv_admission, kv_evict=kv_evict,
                    kv_overlap=kv_overlap, admission=admission, admission_wait=admission_wait,
                    admission_queue=admission_queue, block_tokens=block_tokens,
                    router_options=router_options, path=path or PathLatency())
    return Simulator(cfg).run(list(sessions))
