"""The simulator's remote prefills: a prefill worker's task in service, its KV reads (ahead, with
the overlap) and write-back, timed under NIC contention when it is on."""
from __future__ import annotations

from heapq import heappush
from typing import Any

from ampd.policy import PrefillTask
from ampd.worker import KvRead, PrefillWork

from .events import COMPUTE_DONE, COMPUTE_START, HANDOFF, REMOTE_DONE
from .tiering import Tiering
from .workers import Prefill, Sess


class RemotePrefilling(Tiering):
    """The prefill workers' handlers of ``ampd.sim.loop._Run``. One object holds every handler: the
    dispatch loop calls them as its own methods, with no hop through a collaborator per event."""

    __slots__ = ("heap", "seq", "busy_extra", "contention", "handoff_s")
    heap: list[tuple[float, int, int, Any]]
    seq: int
    busy_extra: float
    contention: bool
    handoff_s: float

    # _Run's method these handlers call (typed here; _Run's own overrides it; ``push``: Tiering's)
    def first_token(self, st: Sess, now: float) -> None: ...

    # -------------------------------------------------------------------------- prefill workers
    def prefill_next(self, p: Prefill, now: float) -> None:
        if p.current is not None or (not p.queue_len and p.ahead is None):
            return
        w: PrefillWork = p.schedule(now)  # type: ignore[assignment]  # (a task is queued or read ahead)
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
                self.push(rend + w.compute_s + extra, COMPUTE_DONE, st)
            else:
                p.busy_s += w.compute_s + w.write_s + extra
                self.push(rend + w.compute_s + w.write_s + extra, REMOTE_DONE, st)
            p.cs_event = False
            if rend <= now:
                self.compute_start((p, w.task), now)
            elif p.queue_len:  # a queued task's read starts when this one computes
                self.push(rend, COMPUTE_START, (p, w.task))
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
            self.push(rend + w.compute_s + extra, COMPUTE_DONE, st)
        else:
            dur = w.total_s
            p.busy_s += dur + extra
            self.seq += 1
            heappush(self.heap, (now + dur + extra, self.seq, REMOTE_DONE, st))

    def submit_remote(self, p: Prefill, task: PrefillTask, now: float) -> None:
        r = p.submit(task, now)
        if r is not None:
            self.read_ahead(p, r, now)
        elif p.kv_overlap and p.current is not None and not p.cs_event and now < p.compute_at:
            self.push(p.compute_at, COMPUTE_START, (p, p.current))  # queued during a read
            p.cs_event = True
        self.prefill_next(p, now)

    def read_ahead(self, p: Prefill, r: KvRead, now: float) -> None:
        """KV overlap: the next task's history read starts now (sharing NICs under contention)."""
        if self.contention and r.task.l_hist:
            d = self.live[r.task.session_id].dw
            end = max(now, d.nic, p.nic) + r.seconds
            p.read_ahead_until(end)
            d.nic = p.nic = end

    def compute_start(self, obj: tuple[Prefill, PrefillTask], now: float) -> None:
        """KV overlap: the task in service has its history and computes; the next task leaves the
        queue and its read starts. Only scheduled while a task waits in the queue (an event per
        remote prefill would cost ~10 % of a paper-scale run for nothing)."""
        p, task = obj
        if p.current is not task:
            return  # that task already ended (zero compute and write-back)
        r = p.compute_started(now)
        if r is not None:
            self.read_ahead(p, r, now)

    def compute_done(self, st: Sess, now: float) -> None:
        """NIC contention: the new KV's write-back waits for both workers' NICs."""
        p: Prefill = st.pw  # type: ignore[assignment]  # (prefill_next set it)
        d = st.dw
        start = max(now, d.nic, p.nic)
        end = start + st.write_s
        d.nic = p.nic = end
        p.busy_s += end - now
        self.push(end, REMOTE_DONE, st)

    def remote_done(self, st: Sess, now: float) -> None:
        p: Prefill = st.pw  # type: ignore[assignment]  # (prefill_next set it, and pwork)
        st.pw = None
        p.update(st.pwork, now)  # type: ignore[arg-type]  # (as pw)
        st.pwork = None
        at = now + self.handoff_s
        if st.kv_ready > at:  # host tier: the history's fetch to the device is not done
            at = st.kv_ready
        if at > now:
            self.push(at, HANDOFF, st)
        else:
            self.first_token(st, now)
        self.prefill_next(p, now)
