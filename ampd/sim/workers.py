"""What the simulator keeps per worker and per session, around the shared worker cores: a decode
worker's step log and NIC, a prefill worker's NIC and busy time, a session's script and records, the
prefill views read per routing decision, and the profile as the simulated decode workers run it."""
from __future__ import annotations

import math
from collections import deque

from ampd.policy import WorkerView
from ampd.worker import DecodeCore, DecodeSession, PrefillCore, PrefillWork
from ampd.workload.trace import Round

from .result import SimSession
from .steplog import StepLog

__all__ = ["Decode", "Prefill", "Views", "Waiting", "Sess", "SlowerSteps"]


class Decode(DecodeCore):
    """A decode worker in the simulator: the core plus its step log and NIC. Built as the core is,
    then ``sim_init`` (no ``__init__`` of its own: compiled by mypyc 2.4, a forwarded ``*args`` or
    ``**kw`` reaches the core's ``__init__`` packed wrongly)."""

    __slots__ = ("idx", "log", "nic", "log_row", "link", "offloads")

    def sim_init(self, idx: int) -> Decode:
        self.idx = idx
        self.view_tasks = False  # nothing in the simulator reads WorkerView.queue
        lg = self.log = StepLog()
        self.nic = 0.0  # when its NIC is free (kv_contention)
        self.link = 0.0  # when its device-host link is free (the host KV tier)
        self.offloads: deque = deque()  # (end, tokens) of its offloads on the link, by end
        # the step log's row append, bound once (step_done runs per run of steps)
        self.log_row = lg.rows.extend
        return self


class Prefill(PrefillCore):
    """A prefill worker in the simulator: the core plus its NIC and busy time (built as the core is,
    then ``sim_init``, as ``Decode``)."""

    __slots__ = ("nic", "cs_event", "busy_s")

    def sim_init(self) -> Prefill:
        self.view_tasks = False  # nothing in the simulator reads WorkerView.queue
        self.nic = 0.0
        self.busy_s = 0.0  # the simulator knows the real durations (NIC contention, PathLatency)
        self.cs_event = False  # a COMPUTE_START event is scheduled for the task in service
        return self


class Views:
    """The prefill workers' views for one routing decision, each built on first read. Algorithm 1
    stops at the first prefill worker with slack (most decisions), so most views are never read;
    the router is pure and nothing changes while it runs, so a view built late equals one built
    up front. After the decision the driver (``_Run.route``, which also resets ``now`` and ``vs``
    per decision) reads the windowed mean of every worker whose view was not built: that read
    expires old samples, and the window's float sum depends on when they leave, so every worker's
    window moves exactly as when every view was built."""

    __slots__ = ("ps", "now", "vs", "blank")

    def __init__(self, ps: list[Prefill], now: float):
        self.ps = ps
        self.now = now
        self.blank: list[WorkerView | None] = [None] * len(ps)
        self.vs = self.blank[:]

    def __len__(self) -> int:
        return len(self.ps)

    def __getitem__(self, i: int) -> WorkerView:
        v = self.vs[i]
        if v is None:
            v = self.vs[i] = self.ps[i].view(self.now)
        return v

    def __iter__(self):
        for i in range(len(self.ps)):
            yield self[i]


class Waiting:
    """A new session that admission has not bound yet (its ticket in the ``AdmissionBook``)."""

    __slots__ = ("s", "rec", "need", "at", "check_at", "done")

    def __init__(self, s, rec: SimSession, need: int, at: float):
        self.s = s
        self.rec = rec
        self.need = need
        self.at = at  # arrival: what its wait and its first round's TTFT count from
        self.check_at = math.inf  # the earliest ADMIT_CHECK pending for it
        self.done = False


class Sess(DecodeSession):
    """A session on its decode worker, plus its script (rounds), where its record goes and the KV
    admission promised it."""

    __slots__ = ("rounds", "rec", "dw", "ready", "local", "pw", "pwork", "write_s", "target", "need", "kv_back",
                 "kv_ready", "kv_early")

    def __init__(self, sid: str, rounds: tuple[Round, ...], rec: SimSession, dw: Decode, need: int):
        super().__init__(sid)
        self.rounds = rounds  # (typed: compiled, a round's fields are then read directly)
        self.rec = rec
        self.dw = dw
        self.need = need
        self.ready = 0.0  # the current round's input-ready time
        self.local = False
        self.pw: Prefill | None = None  # the prefill worker running its remote prefill
        self.pwork: PrefillWork | None = None  # ... and what it runs
        self.write_s = 0.0
        self.target = ""
        self.kv_back = 0.0  # host tier: when the last fetch of its KV from the host ends
        self.kv_ready = 0.0  # host tier: when its worker's device holds its history (a remote prefill's
        # first token waits for it)
        self.kv_early = 0.0  # host tier: when its last early prefetch (before its round) ends


class SlowerSteps:
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
