"""What a simulation run produced: compact per-session and per-round records plus the step logs
that hold the token times (``ampd.sim.steplog``)."""
from __future__ import annotations

import math
from typing import NamedTuple

from .steplog import StepLog, itl_samples

__all__ = ["SimRound", "SimSession", "SimResult"]


class SimRound(NamedTuple):
    """One round as the simulator saw it (compact: token times live in the worker's step log).

    ``worker`` is the index of the decode worker (its step log holds the token times), ``target``
    the worker id the prefill ran on. A named tuple: a paper-scale run records ~1.1M rounds, and
    one C call builds each (``tuple.__new__``), where a class's ``__init__`` runs a line per field."""

    round: int
    input_ready: float
    first_token: float
    last_token: float
    n_tokens: int
    local: bool
    worker: int
    step_lo: int
    target: str

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
    """Per-session outcome: the rounds it finished, where it was bound, and why it did not
    complete (``error``: empty when it completed or was still running at the end)."""

    __slots__ = ("session_id", "arrival", "rounds", "decode_worker", "completed", "end", "error")

    def __init__(self, session_id: str, arrival: float, decode_worker: str) -> None:
        self.session_id = session_id
        self.arrival = arrival
        self.rounds: list[SimRound] = []
        self.decode_worker = decode_worker
        self.completed = False
        self.end = math.nan
        self.error = ""


class SimResult:
    """What a run produced: per-session outcomes plus the step logs that hold the token times."""

    def __init__(self, policy: str, sessions: list[SimSession], step_logs: list[StepLog], duration_s: float,
                 stats: dict, worker_ids: list[str]) -> None:
        self.policy = policy
        self.sessions = sessions
        self.step_logs = step_logs
        self.duration_s = duration_s
        self.stats = stats
        self.worker_ids = worker_ids

    def itl_samples(self):
        """Every token gap of the run as (values, weights) numpy arrays (``steplog.itl_samples``)."""
        return itl_samples(self.step_logs, self.sessions)

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
