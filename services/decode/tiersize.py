"""The decode worker's host KV tier at start-up (``--kv-host-mb``, ``--kv-host-ratio``): the host
pool it starts with, or a ConfigError naming the sizes (the tier itself: services/decode/tier.py)."""
from __future__ import annotations

from ampd.config import ConfigError
from ampd.policy.hostpool import HostPoolSize, HostPoolTooLarge, HostPoolTooSmall, size_host_pool

__all__ = ["check_host_tier", "available_memory_bytes"]


def check_host_tier(host_mb: float, block_tokens: int, bytes_per_token: int, session_tokens: int,
                    engine: str = "mock", kv_in_pool: bool = True, offload_pressure: float = 0.7, *,
                    ratio: float = 0.0, device_bytes: int = 0, available_bytes: int | None = None) -> HostPoolSize:
    """The host pool this decode worker starts with (``mb`` 0: the tier is off): ``--kv-host-mb``
    when given, else ``ratio`` x the ``device_bytes`` device pool (ampd.policy.hostpool.size_host_pool).
    A ConfigError naming the sizes when an explicit host pool cannot hold one session's KV of
    ``session_tokens`` tokens (the engine's context, at most the device pool) or exceeds
    ``available_bytes``, when it is given for an engine that keeps its KV outside the worker's pool
    (nothing there for the tier to move), or when ``offload_pressure`` is not a fraction of the pool.
    A ratio-sized pool never refuses the start: it is off (with a ``note``) where it cannot work."""
    if host_mb == 0 and ratio == 0:
        return HostPoolSize(0.0, "off")
    if not 0.0 <= offload_pressure <= 1.0:
        raise ConfigError(f"--kv-offload-pressure must be in [0, 1] (a share of the decode KV pool), "
                          f"got {offload_pressure:g}")
    if not kv_in_pool:
        if host_mb == 0:
            return HostPoolSize(0.0, "off", f"engine {engine!r} keeps its KV outside the worker's pool: the host KV "
                                            "tier is off")
        raise ConfigError(f"--kv-host-mb {host_mb:g}: engine {engine!r} keeps its KV outside the worker's pool, "
                          "and the host tier moves the pool's KV (engines mock and torch); run with --kv-host-mb 0 "
                          "--kv-host-ratio 0")
    try:
        return size_host_pool(host_mb, ratio, device_bytes, block_tokens, bytes_per_token, session_tokens,
                              available_bytes)
    except (HostPoolTooSmall, HostPoolTooLarge) as exc:
        raise ConfigError(str(exc)) from None


def available_memory_bytes() -> int | None:
    """Memory this process may still use: the host's MemAvailable, or less where its cgroup (a
    container's memory limit) leaves less; None where neither can be read."""
    out: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            out += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                lim = f.read().strip()
            with open(usage) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if lim.isdigit() and int(lim) < 1 << 60:  # "max" or v1's huge number: no limit
            out.append(max(0, int(lim) - used))
        break
    return min(out) if out else None
