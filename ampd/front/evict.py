"""Which idle sessions a front closes to make room. Pure: takes the time as an argument.

Two pressures:
- KV (`kv_victims`): the deployment refused a new session for lack of KV (`kv-full`). The front's
  idle sessions past the grace (`idle_grace`) go, least recently used first, until one decode worker
  got back at least what the new session needs: admission had less than that free there, so the
  retried session fits (unless another session takes the room first, or another front's sessions
  hold it: then the next refusal evicts more).
- A tenant's caps (`tenant_victims`): its live sessions and the KV tokens its sessions' histories
  hold. Beyond either, its own least recently used idle sessions go, whatever their idle time (it
  is the tenant's own choice which conversation goes on).

An evicted session comes back by a prefill of its whole history when its conversation continues.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Held", "kv_victims", "grace_ends", "tenant_victims"]


@dataclass(frozen=True)
class Held:
    """What the choice needs of one live session."""
    session_id: str
    last_used: float  # when its last turn ended (monotonic seconds)
    busy: bool = False
    worker: str = ""  # its decode worker ("" not known)
    promised: int = 0  # KV tokens the deployment promised it: every turn's input and max_tokens
    tokens: int = 0  # its history


def _lru_idle(held: Sequence[Held], now: float, grace_s: float) -> list[Held]:
    return sorted((h for h in held if not h.busy and now - h.last_used >= grace_s), key=lambda h: h.last_used)


def kv_victims(held: Sequence[Held], now: float, grace_s: float, need: int) -> tuple[list[str], bool]:
    """The idle sessions past the grace to close, least recently used first, until the KV promised
    to those on one decode worker reaches ``need``, and True; all of them and False when none does."""
    out: list[str] = []
    freed: Counter[str] = Counter()
    for h in _lru_idle(held, now, grace_s):
        out.append(h.session_id)
        freed[h.worker] += h.promised
        if freed[h.worker] >= need:
            return out, True
    return out, False


def grace_ends(held: Sequence[Held], now: float, grace_s: float) -> float | None:
    """When the next idle session within its grace passes it (None: no idle session is within it)."""
    ends = [h.last_used + grace_s for h in held if not h.busy and now - h.last_used < grace_s]
    return min(ends) if ends else None


def tenant_victims(idle: Sequence[Held], sessions: int, tokens: int, max_sessions: int, max_tokens: int
                   ) -> list[str] | None:
    """``sessions`` and ``tokens``: a tenant's live sessions and the KV tokens of their histories,
    the request's included; ``idle``: its idle sessions the request may displace. The least recently
    used of them to close so that both are within their caps (0: no cap), or None when closing
    every one would not do."""
    out: list[str] = []
    for h in sorted(idle, key=lambda h: h.last_used):
        if (not max_sessions or sessions <= max_sessions) and (not max_tokens or tokens <= max_tokens):
            return out
        out.append(h.session_id)
        sessions -= 1
        tokens -= h.tokens
    if (not max_sessions or sessions <= max_sessions) and (not max_tokens or tokens <= max_tokens):
        return out
    return None
