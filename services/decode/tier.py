"""The host KV tier of the live decode worker (``--kv-host-mb``; ``ampd.worker.decode_tier``).

Off (``--kv-host-mb 0``, the default) nothing here runs. On, the worker checks at start-up that the
host pool can hold one session's KV (HostPoolTooSmall names the sizes) and then refuses to start:
the decode core decides the tier's moves (``DecodeCore.take_moves``), but the live worker does not
yet perform them through the KV transport (device blocks to host segments and back, checked byte
for byte), and a tier whose moves are not performed would lose KV. The simulator models the tier
(``ampd simulate --kv-host-mb``).
"""
from __future__ import annotations

from ampd.config import ConfigError
from ampd.policy.hostpool import HostPoolTooSmall, check_host_pool

__all__ = ["NOT_WIRED", "check_host_tier"]

NOT_WIRED = ("--kv-host-mb {mb:g}: the live decode worker's host KV tier is not wired yet (its moves between the "
             "device pool and the host pool through the KV transport are not performed); run with --kv-host-mb 0, "
             "or model the tier with `ampd simulate --kv-host-mb`")


def check_host_tier(host_mb: float, block_tokens: int, bytes_per_token: int, session_tokens: int) -> None:
    """Nothing when the tier is off (``host_mb`` 0). On: a ConfigError naming the sizes when the host
    pool cannot hold one session's KV of ``session_tokens`` tokens (the engine's context, at most the
    device pool), else a ConfigError saying the live tier's moves are not wired."""
    if host_mb == 0:
        return
    try:
        check_host_pool(host_mb, block_tokens, bytes_per_token, session_tokens)
    except HostPoolTooSmall as exc:
        raise ConfigError(str(exc)) from None
    raise ConfigError(NOT_WIRED.format(mb=host_mb))
