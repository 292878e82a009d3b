"""The event loop: the worker cores (``ampd.worker``) and the policy cores (``ampd.policy``) driven
on a virtual clock.

Every decode worker is a ``DecodeCore`` and every prefill worker a ``PrefillCore``, the same cores
the live services drive; this module only turns what they say into timed events and back. It adds
what only a simulation has: the sessions' scripted rounds and tool calls, the control path's
latencies (``PathLatency``), NIC contention between KV transfers, and the step logs that keep every
token time in closed form (``ampd.sim.steplog``). docs/simulator.md explains the model.

Hot path (100k GAIA sessions on 32 GPUs in well under a minute on one core): one heap event per run
of decode steps, never per step or token; heap entries are plain tuples ``(time, seq, code, obj)``
(``seq`` breaks ties in push order); handlers are methods of one slotted object (``_Run``, with
its admission handlers in ``ampd.sim.admitting`` and its prefill workers' in ``ampd.sim.remote``).
The simulator's records of workers and sessions are in ``ampd.sim.workers``.
"""
from __future__ import annotations

from heapq import heappop, heappush
import math
import time as _time
from typing import Sequence

from ampd.policy import SLO, PrefillTask, in_worker_order, make_queue, make_router, policy_spec
from ampd.policy.admit import AdmissionBook
from ampd.policy.hints import HINTS, queue_yield_s
from ampd.policy.hostpool import check_host_pool, size_host_pool
from ampd.policy.kvtier import KVTierConfig
from ampd.worker import (ADMITTED, FAILED, IDLE, STEPPING, DecodeRun, HostTier, LocalPrefill)

from ampd.deployment import expand_spec, format_spec, parse_spec

from .admitting import Admitting
from .config import PathLatency, SimConfig
from .events import (ADMIT_CHECK, COMPUTE_DONE, COMPUTE_START, DISPATCH, HANDOFF, PIN_EXPIRED, PREFILL_DONE,
                     REMOTE_DONE, ROUND_READY, STEP_DONE, TIER_LOCAL, TIER_PREFETCH, TIER_READY,
                     TIER_REMOTE)
from .gcpause import gc_paused
from .result import SimResult, SimRound
from .steplog import pack_row
from .workers import Decode, Prefill, Sess, SlowerSteps, Views

__all__ = ["Simulator", "simulate"]

# SimRound(...) without its Python-level __new__ (a named tuple): one C call per round, used by
# _Run.round_end only (timeit, Python 3.11: 128 ns against 326 ns; ~0.2 s of a paper-scale run's
# ~1.1M rounds)
_new_round = tuple.__new__


def _host_mb(cfg: SimConfig, prof, tp: int) -> float:
    """The host KV tier of a decode worker of degree ``tp``, MiB (0: off), as a live decode worker
    sizes it (``ampd.policy.hostpool.size_host_pool``, no memory cap: the simulated host is the
    profile's)."""
    cap = int(prof.kv_capacity_tokens(tp))
    longest = cap // cfg.block_tokens * cfg.block_tokens  # a session the device holds in whole blocks, as live
    return size_host_pool(cfg.kv_host_mb, cfg.kv_host_ratio, cap * prof.kv_bytes_per_token, cfg.block_tokens,
                          prof.kv_bytes_per_token, 0 if cfg.kv_host_mb else longest).mb


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
        dprof = SlowerSteps(prof, step_s) if step_s else prof
        self.decodes = [
            Decode(f"decode-{i}", tp, dprof, make_queue(spec.decode_queue, prof, slo, tp, window=rw),
                    kv_capacity_tokens=int(prof.kv_capacity_tokens(tp)), window_s=w,
                    chunk_tokens=int(prof.prefill_chunk_tokens(tp)) if cfg.chunked_prefill else 0,
                    kv_admission=cfg.kv_admission, kv_evict=cfg.kv_evict,
                    tier=HostTier.from_mb(_host_mb(cfg, prof, tp), cfg.block_tokens, prof.kv_bytes_per_token, 0,
                                          KVTierConfig(offload_pressure=cfg.kv_offload_pressure),  # run() checks
                                          prefetch_early=cfg.kv_prefetch_early)).sim_init(i)
            for i, tp in enumerate(expand_spec(dec_groups))
        ]
        # the coordinator's order (ampd.policy.order): Algorithm 1's seeded visits and every tie agree
        self.prefills = in_worker_order([
            Prefill(f"prefill-{i}", tp, prof, make_queue(spec.prefill_queue or "fcfs", prof, slo, tp, window=rw),
                    window_s=w, kv_overlap=cfg.kv_overlap,
                    kv_capacity_tokens=int(prof.kv_capacity_tokens(tp))).sim_init()
            for i, tp in enumerate(expand_spec(pre_groups))
        ])
        self.by_id: dict[str, Decode | Prefill] = {d.worker_id: d for d in self.decodes}
        self.by_id.update({p.worker_id: p for p in self.prefills})
        self.gpus = sum(tp * r for tp, r in (*pre_groups, *dec_groups))
        AdmissionBook(cfg.admission, cfg.admission_wait, cfg.admission_queue, prof, slo)  # checks the rule

    def run(self, sessions: Sequence) -> SimResult:
        if self.cfg.kv_host_mb and sessions:  # HostPoolTooSmall when one session's KV cannot fit
            longest = max(sum(int(r.input) + int(r.output) for r in s.rounds) for s in sessions)
            check_host_pool(self.cfg.kv_host_mb, self.cfg.block_tokens, self.profile.kv_bytes_per_token, longest)
        with gc_paused():
            return _Run(self).go(sessions)


def _queue_yield_s(h) -> float:
    """A round's ``PrefillTask.queue_yield_s`` from its turn's hints (None: none), as the live decode worker
    reads them (``ampd.agenthints.turn_queue_yield_s``): a yielding round is queued later."""
    return 0.0 if h is None else queue_yield_s(h.priority, HINTS)


class _Run(Admitting):
    """One simulation run: the event heap, the sessions in flight and the handlers (its bases, a
    chain: ``Prefixing``)."""

    __slots__ = ("reasons", "n_local", "n_remote", "n_failed", "router", "pviews_static", "pviews", "route_fn",
                 "tool_rpc_s")

    def __init__(self, sim: Simulator):
        cfg = sim.cfg
        self.sim = sim
        self.heap = []
        self.seq = 0
        self.live = {}
        self.outcomes = []
        self.reasons: dict[str, int] = {}
        self.n_local = self.n_remote = self.n_failed = 0
        self.book = AdmissionBook(cfg.admission, cfg.admission_wait, cfg.admission_queue, sim.profile, sim.slo)
        self.block_tokens = cfg.block_tokens
        self.refused = {}  # admission's refusals by reason
        self.n_waited = 0  # sessions that waited for admission
        self.decodes = sim.decodes
        self.prefills = sim.prefills
        self.by_id = sim.by_id
        self.router = sim.router
        self.pviews_static = not sim.prefills
        self.pviews = Views(sim.prefills, 0.0)
        self.route_fn = sim.router.route
        self.pin_ttl = sim.kv_pin_ttl_s
        self.kv_evict = cfg.kv_evict
        path = cfg.path or PathLatency()
        self.open_s, self.dispatch_s, self.handoff_s = path.open_s, path.dispatch_s, path.handoff_s
        self.tool_rpc_s, self.busy_extra = path.tool_s, path.prefill_busy_s
        self.contention = cfg.kv_contention
        self.delayed = bool(self.open_s or self.dispatch_s)
        self.tier = any(d.tier is not None for d in sim.decodes)
        self.tier_to = self.tier_from = 0  # tokens moved to and from the host tier
        self.prefix_init(cfg)

    def push(self, t: float, code: int, obj) -> None:
        self.seq += 1
        heappush(self.heap, (t, self.seq, code, obj))

    # ------------------------------------------------------------------------------- the loop
    def go(self, sessions: Sequence) -> SimResult:
        wall0 = _time.perf_counter()
        self.prefix_park(sessions)
        order = sorted(range(len(sessions)), key=lambda i: (sessions[i].arrival, i))
        ids_seen: set = set()
        heap = self.heap
        pop = heappop
        n_events = 0
        ai = 0
        na = len(order)
        next_arr = float(sessions[order[0]].arrival) if na else math.inf
        now = 0.0
        # (the handlers called as methods, not bound once into locals: compiled, a method call is a
        # direct call, and a bound method a call through Python's protocol; ampd/compiled.py)
        while True:
            if heap and heap[0][0] <= next_arr:
                now, _, code, obj = pop(heap)
            elif ai < na:
                now = next_arr
                self.arrive(sessions[order[ai]], now, ids_seen)
                ai += 1
                next_arr = float(sessions[order[ai]].arrival) if ai < na else math.inf
                n_events += 1
                continue
            else:
                break
            n_events += 1
            if code == STEP_DONE:
                if obj[1] == obj[0].run_ver:  # else a run that was cut short (~0.6 a round)
                    self.step_done(obj, now)
            elif code == REMOTE_DONE:
                self.remote_done(obj, now)
            elif code == ROUND_READY:
                self.round_ready(obj, now)
            elif code == PREFILL_DONE:
                self.prefill_done(obj, now)
            elif code == DISPATCH:
                self.route(obj, now)
            elif code == HANDOFF:
                self.first_token(obj, now)
            elif code == PIN_EXPIRED:
                d = obj.dw
                if d.pin_expired(obj):
                    self.drain(d, now)
            elif code == COMPUTE_START:
                self.compute_start(obj, now)
            elif code == COMPUTE_DONE:
                self.compute_done(obj, now)
            elif code == ADMIT_CHECK:
                if not obj.done:
                    obj.check_at = math.inf
                    self.admit(obj, now)
            elif code == TIER_READY:
                self.dispatch0(obj, now)
            elif code == TIER_PREFETCH:
                self.tier_prefetch(obj, now)
            elif code == TIER_LOCAL:
                self.tier_local(obj, now)
            elif code == TIER_REMOTE:
                self.submit_remote(obj[0], obj[1], now)
        return self.result(now, n_events, _time.perf_counter() - wall0, len(sessions))

    def round_ready(self, st: Sess, now: float, ready: float = -1.0) -> None:
        """The round's input is ready at ``ready`` (default ``now``; a first round: the arrival)."""
        rnd = st.rounds[st.round]
        if self.tier and st.round:
            prev = st.rounds[st.round - 1]
            st.dw.tier.durations.observe(  # type: ignore[union-attr]  # (self.tier: every worker has one)
                prev.tool or "", now, (prev.tool_s or 0.0) + self.tool_rpc_s)
        st.ready = now if ready < 0.0 else ready
        st.l_incr = int(rnd.input)
        st.out = int(rnd.output)
        if self.prefix is not None and not st.round:
            self.prefix_first(st)
        d = st.dw
        code = self.prefix_round_ready(st, now) if self.prefix_kv else d.round_ready(st, now)
        if self.prefix is not None:  # the round's KV takes cached blocks' space first
            self.prefix_trim(d)
        if code == ADMITTED:
            self.dispatch(st, now)
        elif code == FAILED:
            self.n_failed += 1
            rec = st.rec
            rec.error = st.error
            rec.end = now
            del self.live[st.session_id]
            if self.prefix is not None:
                self.prefix_release(st, st.round > 0)
            self.release(st, now)
        else:
            self.drain(d, now)

    def drain(self, d: Decode, now: float) -> None:
        """Route every waiting round whose KV now fits."""
        pk = self.prefix_kv
        while True:
            st = self.prefix_admit_next(d, now) if pk else d.admit_next(now)
            if st is None:
                return
            self.dispatch(st, now)  # type: ignore[arg-type]  # (the core's sessions are Sess)

    def round_end(self, st: Sess, now: float, last: float) -> None:
        d = st.dw
        out = st.out
        self.round_samples(st, last)
        st.rec.rounds.append(_new_round(SimRound, (st.round, st.ready, st.first, last, out, st.local, d.idx,
                                                   st.lo if out > 1 else 0, st.target)))
        rounds = st.rounds
        final = st.round + 1 >= len(rounds)
        d.round_end(st, final)
        if not final:
            rnd = rounds[st.round]
            tool = rnd.tool_s
            tool = (tool if tool and tool > 0 else 0.0) + self.tool_rpc_s
            st.round += 1
            self.seq += 1
            heappush(self.heap, (now + tool, self.seq, ROUND_READY, st))
            if self.prefix_kv:
                self.prefix_pin(st)
            if self.pin_ttl is not None:
                if tool > self.pin_ttl:  # the policy pins the KV for its TTL (kv_evict or not)
                    d.tool_call(st, pin=True)
                    self.push(now + self.pin_ttl, PIN_EXPIRED, st)
            elif self.tier:  # the session's turn's hint (round 0's), as the live decode worker reads it
                h = st.rounds[0].hints
                self.tier_pause(st, now, rnd.tool, None if h is None else h.expected_tool_s)
            elif self.kv_evict and d.tool_call(st):
                self.drain(d, now)
        else:
            st.rec.completed = True
            st.rec.end = now
            del self.live[st.session_id]
            if self.prefix is not None:
                self.prefix_release(st, True)
            self.drain(d, now)
            self.release(st, now)

    def first_token(self, st: Sess, now: float) -> None:
        d = st.dw
        if self.prefix is not None and not st.round:  # its prefill wrote the prompt's KV
            self.prefix_commit(st)
        if not d.first_token(st, now):
            self.round_end(st, now, now)
        elif d.state == IDLE:
            self.decode_next(d, now)
        elif d.state == STEPPING:
            self.interrupt(d, now)

    # --------------------------------------------------------------------------------- routing
    def dispatch(self, st: Sess, now: float) -> None:
        """An admitted round goes to routing: through the host tier's moves where there is one."""
        if self.tier:
            self.tier_dispatch(st, now)
        else:
            self.dispatch0(st, now)

    def dispatch0(self, st: Sess, now: float) -> None:
        """An admitted round goes to routing, after the control path's latency where it has one."""
        if self.delayed:
            self.dispatch_later(st, now)
        else:
            self.route(st, now)

    def dispatch_later(self, st: Sess, now: float) -> None:
        """Route the round once the control path has carried it (PathLatency)."""
        delay = self.dispatch_s + self.open_s if st.round == 0 else self.dispatch_s
        if delay:
            self.push(now + delay, DISPATCH, st)
        else:
            self.route(st, now)

    def route(self, st: Sess, now: float, kv: tuple | None = None) -> None:
        """Route the round (``kv``: the host tier's (KV state, seconds until its KV is on the device, fetch first))."""
        d = st.dw
        if kv is None:
            task = PrefillTask(st.session_id, st.round, st.l_hist, st.l_incr, st.ready, d.worker_id, d.tp)
        else:
            task = PrefillTask(st.session_id, st.round, st.l_hist, st.l_incr, st.ready, d.worker_id, d.tp,
                               kv_state=kv[0], kv_fetch_s=kv[1], kv_fetch_first=kv[2])
        task.queue_yield_s = _queue_yield_s(st.rounds[0].hints)  # (the session's one turn's, every round)
        dview = d.view(now)
        if self.pviews_static:
            dec = self.router.route(task, dview, (), now)
        else:
            pviews = self.pviews
            # a fresh Views per decision; after it, the unread workers' windows move (see Views)
            pviews.now = now
            vs = pviews.vs = pviews.blank[:]
            dec = self.route_fn(task, dview, pviews, now)  # type: ignore[arg-type]  # (Views: a lazy sequence)
            for pw, v in zip(pviews.ps, vs):
                if v is None:
                    pw.window.mean(now)
        reasons = self.reasons
        reasons[dec.reason] = reasons.get(dec.reason, 0) + 1
        if dec.local or dec.target == d.worker_id:
            st.local = True
            st.target = d.worker_id
            self.n_local += 1
            if kv is not None and kv[1]:  # its KV comes back from the host first
                self.push(now + kv[1], TIER_LOCAL, (st, task))
                return
            d.submit_local(task)
            if d.state == IDLE:
                self.decode_next(d, now)
            elif d.state == STEPPING:
                self.interrupt(d, now)
            return
        p = self.by_id.get(dec.target)
        if not isinstance(p, Prefill):
            raise RuntimeError(f"router {self.sim.cfg.policy!r} chose unknown prefill worker {dec.target!r}")
        st.local = False
        st.target = p.worker_id
        self.n_remote += 1
        if kv is not None and kv[1] and self.tier_remote_later(st, p, task, now, kv[1]):
            return
        self.submit_remote(p, task, now)

    # --------------------------------------------------------------------------- decode workers
    def decode_next(self, d: Decode, now: float) -> None:
        act = d.schedule(now)
        if act is None:
            return
        self.seq += 1
        if type(act) is DecodeRun:
            heappush(self.heap, (act.end, self.seq, STEP_DONE, (d, d.run_ver)))
        else:
            heappush(self.heap, (act.end, self.seq, PREFILL_DONE, act))

    def interrupt(self, d: Decode, now: float) -> None:
        """Something for this worker arrived mid-run: end the run at the next step boundary."""
        end = d.cut(now)
        if end is not None:
            self.push(end, STEP_DONE, (d, d.run_ver))

    def step_done(self, obj: tuple[Decode, int], now: float) -> None:
        d = obj[0]  # the loop dropped the runs that were cut short
        n = d.batch_size
        # one row per run of steps (StepLog.FIELDS order)
        d.log_row(pack_row(d.step_idx, d.run_t0, d.run_first_s, d.run_growth_s, d.run_steps, n,
                           n - d.run_joined, d.last_end))
        run = d.run
        assert run is not None  # (the run in service ended)
        for st in d.update(run, now):
            self.round_end(st, now, now)  # type: ignore[arg-type]  # (the core's sessions are Sess)
        act = d.schedule(now)  # decode_next, inlined: once per run of steps
        if act is not None:
            self.seq += 1
            if type(act) is DecodeRun:
                heappush(self.heap, (act.end, self.seq, STEP_DONE, (d, d.run_ver)))
            else:
                heappush(self.heap, (act.end, self.seq, PREFILL_DONE, act))

    def prefill_done(self, work: LocalPrefill, now: float) -> None:
        d = work.session.dw  # type: ignore[attr-defined]  # (the core's sessions are Sess)
        for st in d.update(work, now):
            self.first_token(st, now)
        if d.state == IDLE:
            self.decode_next(d, now)

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
        if self.tier:
            self.tier_stats(stats)
        self.prefix_stats(stats)
        if sim.cfg.kv_evict:
            stats["kv_recomputed_tokens"] = sum(d.kv_recomputed_tokens for d in decodes)
        return SimResult(sim.cfg.policy, self.outcomes, [d.log for d in decodes], now, stats,
                         [d.worker_id for d in decodes])


def simulate(sessions, profile, *, policy: str, prefill="none", decode=SimConfig.decode,
             ttft_slo_s: float = SimConfig.ttft_slo_s, itl_slo_s: float = SimConfig.itl_slo_s,
             seed: int = SimConfig.seed, window_s: float = SimConfig.window_s,
             kv_contention: bool = SimConfig.kv_contention, reorder_window: int = SimConfig.reorder_window,
             chunked_prefill: bool = SimConfig.chunked_prefill, kv_admission: str = SimConfig.kv_admission,
             kv_evict: bool = SimConfig.kv_evict, kv_overlap: bool = SimConfig.kv_overlap,
             path: PathLatency | None = None, admission: str = SimConfig.admission,
             admission_wait: float = SimConfig.admission_wait, admission_queue: int = SimConfig.admission_queue,
             block_tokens: int = SimConfig.block_tokens, kv_host_mb: float = SimConfig.kv_host_mb,
             kv_host_ratio: float = SimConfig.kv_host_ratio, kv_offload_pressure: float = SimConfig.kv_offload_pressure,
             kv_prefetch_early: bool = SimConfig.kv_prefetch_early,
             prefix_sharing: bool = SimConfig.prefix_sharing, **router_options) -> SimResult:
    """Run ``sessions`` (``ampd.workload.Session``s) on a deployment; see ``SimConfig``."""
    cfg = SimConfig(profile=profile, policy=policy, prefill=prefill, decode=decode,
                    ttft_slo_s=ttft_slo_s, itl_slo_s=itl_slo_s, seed=seed, window_s=window_s,
                    kv_contention=kv_contention, reorder_window=reorder_window,
                    chunked_prefill=chunked_prefill, kv_admission=kv_admission, kv_evict=kv_evict,
                    kv_overlap=kv_overlap, admission=admission, admission_wait=admission_wait,
                    admission_queue=admission_queue, block_tokens=block_tokens, kv_host_mb=kv_host_mb,
                    kv_host_ratio=kv_host_ratio, kv_offload_pressure=kv_offload_pressure, kv_prefetch_early=kv_prefetch_early,
                    prefix_sharing=prefix_sharing, router_options=router_options, path=path or PathLatency())
    return Simulator(cfg).run(list(sessions))
