"""KV pool, session block maps, verifiable KV content, and the NIXL transport.

`NixlTransport` and `KVTransferError` are imported lazily, so that importing `ampd.kv` for the pool
alone does not load NIXL.
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
    "NixlTransport",
]


def __getattr__(name: str):
    if name in ("NixlTransport", "KVTransferError"):
        from . import transport

        return getattr(transport, name)
    raise AttributeError(f"module 'ampd.kv' has no attribute {name!r}")
