"""How the sessions of a replay fared around a fault on one decode worker (pure: no I/O, times given).

Input: the per-session list `ampd bench --json` writes under "sessions" (id, decode_worker,
completed, error, started, ended; client clock). A session is *hit* when it was bound to the faulted
worker and was open at some moment of the fault window [start, end] (from stopping the old container
to the new one being healthy). Every session ends one of four ways:

- completed: its SessionDone with every round (for a hit session: it recovered; the rounds that ran
  on another worker after the loss are marked `recovered` in their RoundTiming, counted too);
- failed: it ended with a clear status (a gRPC error other than a deadline);
- hung: it ran into the client's deadline (DEADLINE_EXCEEDED), or never ended;
- lost: it ended with no error and no SessionDone, or a SessionDone missing rounds (silent loss).

The rules: none hangs and none is lost silently; every session the fault did not hit completes; the
fault hit at least one session (else the run shows nothing). With ``require_complete`` (worker-loss
recovery on main), every hit session completes too.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

OUTCOMES = ("completed", "failed", "hung", "lost")


def outcome(s: dict) -> str:
    if s.get("completed"):
        return "completed"
    err = s.get("error") or ""
    if s.get("ended") is None or err.startswith("DEADLINE_EXCEEDED"):
        return "hung"
    if not err or err == "incomplete" or err.startswith("expected "):
        return "lost"
    return "failed"


def is_hit(s: dict, worker: str, start: float, end: float) -> bool:
    """Bound to ``worker`` and open at some moment of [start, end]. A session that never saw an event
    (no binding) and ended inside the window counts as hit too: it may have been routed there."""
    began, ended = s.get("started") or 0.0, s.get("ended")
    open_in_window = began <= end and (ended is None or ended >= start)
    bound = s.get("decode_worker") or ""
    return open_in_window and (bound == worker or (not bound and not s.get("completed")))


@dataclass
class Verdict:
    hit: Counter = field(default_factory=Counter)      # outcome -> sessions the fault hit
    others: Counter = field(default_factory=Counter)   # outcome -> every other session
    on_worker: int = 0                                  # sessions bound to the faulted worker in all
    recovered_rounds: int = 0                           # rounds the servers marked recovered
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        def fmt(c: Counter) -> str:
            return ", ".join(f"{k} {c[k]}" for k in OUTCOMES)

        label = {"completed": "recovered"}
        hit = ", ".join(f"{label.get(k, k)} {self.hit[k]}" for k in OUTCOMES)
        return (f"sessions hit by the swap: {sum(self.hit.values())} ({hit}); "
                f"others: {sum(self.others.values())} ({fmt(self.others)}); "
                f"bound to the swapped worker in all: {self.on_worker}; rounds marked recovered: "
                f"{self.recovered_rounds}")


def judge(sessions: list[dict], worker: str, start: float, end: float, *,
          require_complete: bool = False) -> Verdict:
    if not start <= end:
        raise ValueError(f"fault window start {start} after its end {end}")
    v = Verdict()
    for s in sessions:
        o = outcome(s)
        v.on_worker += (s.get("decode_worker") == worker)
        v.recovered_rounds += s.get("recovered_rounds") or 0
        hit = is_hit(s, worker, start, end)
        (v.hit if hit else v.others)[o] += 1
        why = f"{s.get('id')} ({s.get('decode_worker') or 'unbound'}): {o}" + (
            f" -- {s.get('error')}" if s.get("error") else "")
        if o in ("hung", "lost"):
            v.problems.append(why)
        elif o == "failed" and (not hit or require_complete):
            v.problems.append(why)
    if not sum(v.hit.values()):
        v.problems.append(f"the swap of {worker} hit no running session: the check shows nothing "
                          "(more or longer sessions in the trace)")
    return v
