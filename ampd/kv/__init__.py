"""KV pool, session block maps, verifiable KV content, and the KV transports.

`KVTransport` (ampd.kv.protocol) is what a transport offers; `NixlTransport` (ampd.kv.transport) is
the one the services use, imported lazily so that importing `ampd.kv` for the pool alone does not
load NIXL; `LoopbackTransport` (ampd.kv.loopback) copies between pools of one process (unit tests).
"""

from .pattern import PatternCache, kv_pattern, session_seed, verify_pattern
from .pool import (
    KVPool,
    KVPoolExhausted,
    PoolLayout,
    Segment,
    SessionKV,
    segments_to_arrays,
    segments_tokens,
)
from .protocol import KVTransferError, KVTransport
from .ranges import pair_ranges

__all__ = [
    "Segment",
    "PoolLayout",
    "KVPool",
    "KVPoolExhausted",
    "SessionKV",
    "segments_tokens",
    "segments_to_arrays",
    "pair_ranges",
    "kv_pattern",
    "PatternCache",
    "verify_pattern",
    "session_seed",
    "KVTransferError",
    "KVTransport",
    "NixlTransport",
]


def __getattr__(name: str):
    if name == "NixlTransport":
        from . import transport

        return getattr(transport, name)
    raise AttributeError(f"module 'ampd.kv' has no attribute {name!r}")
