"""Where a session's KV is when its round is routed: the KV's location (``PrefillTask.kv_state``) and
the seconds until the decode worker's device holds it again (``kv_fetch_s``), from the decode core's
tier state and the profile's transfer time. Pure: no I/O, no clock; ``now`` is passed in.

The wire carries the location as a string (common.proto ``PrefillTask.kv_state``, ``TurnEnd.kv_state``,
decode.proto ``Route.kv_state``): "resident", "host" or "gone", empty meaning resident (what a peer
without a tier sends). ``parse_kv_where`` checks them; a bad value is the sender's error
(INVALID_ARGUMENT), never a guess.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from .kvtier import KVState
from .types import KV_GONE, KV_HOST, KV_RESIDENT

__all__ = ["KVWhere", "RESIDENT", "KVWhereError", "kv_where", "parse_kv_where", "KV_STATES"]

KV_STATES: tuple[str, ...] = (KV_RESIDENT, KV_HOST, KV_GONE)


class KVWhereError(ValueError):
    """A KV location on the wire that is not one (the gRPC layer answers INVALID_ARGUMENT)."""


class KVWhere(NamedTuple):
    """A session's KV location (``KV_RESIDENT``, ``KV_HOST``, ``KV_GONE``) and ``fetch_s``: seconds
    until its history is on the decode worker's device (0 unless on host)."""

    state: str
    fetch_s: float


RESIDENT = KVWhere(KV_RESIDENT, 0.0)


def kv_where(state: KVState | str, fetch_tokens: int, transfer_s: Callable[[int], float], *,
             moving_tokens: int = 0, moving_since: float | None = None, now: float = 0.0) -> KVWhere:
    """The KV's location for routing. ``state``: the decode core's (``HostBlocks.state``);
    ``fetch_tokens``: history tokens on host and not yet being fetched (the core's ``s.fetch``);
    ``moving_tokens``/``moving_since``: a prefetch in flight, its tokens and when it started
    (the core counts such KV resident at once, the device does not hold it yet); ``transfer_s``:
    the profile's seconds to move that many tokens between the device and the host
    (``kvtier.host_transfer_s``).

    - gone: the history is prefilled again (the task's ``l_hist`` is 0); nothing to fetch.
    - on host, not moving: the whole fetch, ``transfer_s(fetch_tokens)``.
    - a prefetch in flight: what is left of it by the profile, never below 0 (a late transfer is
      late, not negative).
    - otherwise resident, 0.
    """
    s = state.value if isinstance(state, KVState) else state
    if s not in KV_STATES:
        raise KVWhereError(f"kv state must be one of {', '.join(KV_STATES)}, got {state!r}")
    if fetch_tokens < 0 or moving_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got fetch_tokens={fetch_tokens}, moving_tokens={moving_tokens}")
    if s == KV_GONE:
        return KVWhere(KV_GONE, 0.0)
    if fetch_tokens > 0:
        return KVWhere(KV_HOST, transfer_s(fetch_tokens))
    if moving_tokens > 0:
        left = transfer_s(moving_tokens) - (0.0 if moving_since is None else max(0.0, now - moving_since))
        return KVWhere(KV_HOST, left if left > 0 else 0.0)
    return RESIDENT  # (on host by the core's count with no tokens to move: nothing to wait for)


def parse_kv_where(state: str, fetch_s: float = 0.0, field: str = "kv_state") -> KVWhere:
    """A location from the wire: ``state`` "resident", "host" or "gone" ("" = resident) and its fetch
    seconds (finite, >= 0; resident KV may wait too, for room that moves still free). KVWhereError
    naming the field and the value otherwise."""
    s = state or KV_RESIDENT
    if s not in KV_STATES:
        raise KVWhereError(f"{field}: {state!r} is not a KV location (one of {', '.join(KV_STATES)}, "
                           "or empty for resident)")
    if not (isinstance(fetch_s, (int, float)) and math.isfinite(fetch_s) and fetch_s >= 0):
        raise KVWhereError(f"kv_fetch_s: must be a finite number of seconds >= 0, got {fetch_s!r}")
    return KVWhere(s, float(fetch_s))
