"""The simulator's admission: sessions arrive and the coordinator's admission core
(``ampd.policy.admit.AdmissionBook``) binds each to a decode worker, refuses it, or lets it wait."""
from __future__ import annotations

import math

from ampd.policy import WorkerView
from ampd.policy.admit import HEAD_POLL_S
from ampd.policy.hints import HINTS, queue_enqueued_at
from ampd.policy.outlen import rounds_kv_tokens

from .events import ADMIT_CHECK
from .remote import RemotePrefilling
from .result import SimSession
from .workers import Decode, Prefill, Sess, Waiting


class Admitting(RemotePrefilling):
    """The admission handlers of ``ampd.sim.loop._Run``. One object holds every handler: the
    dispatch loop calls them as its own methods, with no hop through a collaborator per event. (It
    binds by prefix: ``Prefixing``.)"""

    __slots__ = ("outcomes", "block_tokens", "prefills", "by_id", "refused", "n_waited")
    outcomes: list[SimSession]
    block_tokens: int
    prefills: list[Prefill]
    by_id: dict[str, Decode | Prefill]
    refused: dict[str, int]
    n_waited: int

    # _Run's method these handlers call (typed here; _Run's own overrides it; ``push``: Tiering's)
    def round_ready(self, st: Sess, now: float, ready: float) -> None: ...

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
        need = rounds_kv_tokens((int(r.input), int(r.output)) for r in s.rounds) + self.block_tokens
        self.admit(Waiting(s, rec, need, now), now)

    # ------------------------------------------------------------------------------- admission
    def admit(self, w: Waiting, now: float) -> None:
        """Judge ``w`` (ampd.policy.admit.AdmissionBook, the coordinator's core): bind it, refuse it,
        or let it wait (judged again when KV is released, at the end of its wait, or, as the head
        under the slo rule, every HEAD_POLL_S)."""
        book = self.book
        queued = w in book.waiting
        decode = []
        for d in self.decodes:  # every worker's view, as the coordinator reads them (windows move)
            dv = d.view(now)
            # positional, in WorkerView's field order (worker_id, kind, tp, window_mean_s, queue,
            # kv_free_tokens, queue_predicted_s, kv_host_tokens): 174 ns against 535 ns with keywords (timeit), and
            # an overloaded run judges admission ~10^5 times per 20k sessions (sim_speed at 0.3/s)
            decode.append(WorkerView(dv.worker_id, "decode", dv.tp, dv.window_mean_s, dv.queue, d.kv_cap,
                                     dv.queue_predicted_s, d.tier.host_tokens if d.tier is not None else 0))
        prefills = [p.view(now) for p in self.prefills] if book.rule == "slo" else ()
        h = w.s.rounds[0].hints  # a yielding hint (trace rounds' hints): admission orders it later
        order_at = queue_enqueued_at(w.at, h.priority, HINTS) if h is not None and h.priority < 0 else None
        v = book.judge(w, w.need, int(w.s.rounds[0].input), now - w.at, decode, prefills, order_at=order_at,
                       host_share=book.off_device.share(now) if self.tier else None,
                       expect=self.expected_kv(w, now) if book.rule == "slo" else None)
        if v.worker is None and not v.reason:
            if not queued:
                self.n_waited += 1
            at = now + (min(v.wait_s, HEAD_POLL_S) if book.rule == "slo" and book.head is w else v.wait_s)
            if at <= now:  # a wait shorter than the clock's resolution: the next instant
                at = math.nextafter(now, math.inf)
            if at < w.check_at:
                w.check_at = at
                self.push(at, ADMIT_CHECK, w)
            return
        w.done = True
        head_left = book.leave(w)
        rec = w.rec
        if v.reason:
            self.refused[v.reason] = self.refused.get(v.reason, 0) + 1
            rec.error = f"admission: {v.reason}: {v.detail}"
            rec.end = now
        else:
            wid: str = v.worker  # type: ignore[assignment]  # (bound: set)
            if self.prefix is not None:
                wid = self.prefix_bind(w, wid, decode)
            d = self.by_id[wid]  # type: ignore[assignment]  # (admission binds decode workers only)
            rec.decode_worker = d.worker_id
            st = Sess(rec.session_id, w.s.rounds, rec, d, w.need)
            self.live[rec.session_id] = st
            if self.prefix is not None:
                self.prefix_acquire(st)
            self.round_ready(st, now, w.at)
        if head_left:
            self.admit_head(now)

    def admit_head(self, now: float) -> None:
        """KV was released or the head left: the new head is judged (and so on while they pass)."""
        w: Waiting | None = self.book.head  # type: ignore[assignment]  # (its tickets are Waiting)
        if w is not None:
            self.admit(w, now)

    def expected_kv(self, w: Waiting, now: float) -> int | None:
        """The KV ``w`` is expected to hold (``ampd.policy.outlen``: each round's output, its bound,
        by the windowed mean and the session's ``expected_output_tokens`` hint), as the coordinator
        derives it from the replayed session's one turn (services/coordinator/session.py
        ``expected_kv``): round 0's hints cover every round (docs/workload.md); None without a mean."""
        mean = self.book.outputs.mean(now)
        if mean is None:
            return None
        h = w.s.rounds[0].hints
        hint = None if h is None else h.expected_output_tokens
        return rounds_kv_tokens(((int(r.input), int(r.output)) for r in w.s.rounds), hint, mean) + self.block_tokens

    def round_samples(self, st: Sess, last: float) -> None:
        """The round of ``st`` made its last token at ``last`` (its record not appended yet): a sample
        of admission's estimates, as the coordinator takes from its ``RoundTiming``: of the output
        lengths (``ampd.policy.outlen``) and, with a host KV tier, of the KV that can be on host
        (``ampd.policy.offshare``)."""
        self.book.outputs.observe(last, st.out)
        if not self.tier:
            return
        kv = st.l_hist + st.l_incr + st.out  # (a dropped history is in l_incr again)
        prev = st.rec.rounds[-1] if st.round else None
        self.book.off_device.round_ended(st.ready, last, kv, None if prev is None else prev.last_token,
                                         kv - int(st.rounds[st.round].input) - st.out, self.sim.profile, st.dw.tp)

    def release(self, st: Sess, now: float) -> None:
        """The session ended: its promise frees, for the sessions waiting."""
        self.book.release(st.dw.worker_id, st.need)
        self.admit_head(now)
