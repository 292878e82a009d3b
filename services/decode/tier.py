"""The host KV tier of the live decode worker (``--kv-host-mb``; ``ampd.worker.decode_tier``).

Off (``--kv-host-mb 0``, the default) nothing here runs. On, the worker checks at start-up that the
host pool can hold one session's KV (HostPoolTooSmall names the sizes) and then refuses to start:
the decode core decides the tier's moves (``DecodeCore.take_moves``), but the live worker performs
no moves between its device pool and host memory, and a tier whose moves are not performed would
lose KV. The tier is simulated only (``ampd simulate --kv-host-mb``).
"""
from __future__ import annotations

from ampd.config import ConfigError
from ampd.policy.hostpool import HostPoolTooSmall, check_host_pool

__all__ = ["SIMULATED_ONLY", "check_host_tier"]

SIMULATED_ONLY = ("--kv-host-mb {mb:g}: the host KV tier is simulated only (a live decode worker moves no KV "
                  "to host memory); run with --kv-host-mb 0, or model the tier with `ampd simulate --kv-host-mb`")


def check_host_tier(host_mb: float, block_tokens: int, bytes_per_token: int, session_tokens: int) -> None:
    """Nothing when the tier is off (``host_mb`` 0). On: a ConfigError naming the sizes when the host
    pool cannot hold one session's KV of ``session_tokens`` tokens (the engine's context, at most the
    device pool), else a ConfigError saying the tier is simulated only."""
    if host_mb == 0:
        return
    try:
        check_host_pool(host_mb, block_tokens, bytes_per_token, session_tokens)
    except HostPoolTooSmall as exc:
        raise ConfigError(str(exc)) from None
    raise ConfigError(SIMULATED_ONLY.format(mb=host_mb))
