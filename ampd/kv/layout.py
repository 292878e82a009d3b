"""The KV block layout of a real model in a KVPool, and the token rows of segments.

A pool block holds `block_tokens` positions one after the other, and each position holds all of the
model's KV for that token: `[layers][k, v][kv_heads][head_dim]` of `dtype`. So a block is
`[block_tokens][layers][2][kv_heads][head_dim]` and the whole pool reads as one array of token rows,
`[num_blocks * block_tokens][layers][2][kv_heads][head_dim]`.

Why token-major: a Segment (block, offset, tokens) stays one contiguous byte range, exactly what
`pair_ranges` and `NixlTransport` already move, so a history of whole blocks in a row is one NIXL
descriptor and a partial last block needs no special case. The price is on the engine side: it
gathers a layer's keys as rows of `kv_heads * head_dim` values (768 B for SmolLM2), measured in
benchmarks/torch_engine.py against the model's own compute. Pure numpy, no torch: the pool's
buffer is the memory NIXL registered, and an engine takes views of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .pool import KVPool, Segment, segments_to_arrays

__all__ = ["KVShape", "token_rows", "pool_rows"]


@dataclass(frozen=True)
class KVShape:
    """The per-token KV of one model: `layers` x (k, v) x `kv_heads` x `head_dim` of `dtype`."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"KVShape: {name} must be > 0, got {getattr(self, name)}")
        np.dtype(self.dtype)  # raises TypeError naming the dtype when unknown

    @property
    def row_shape(self) -> tuple[int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    def pool(self, capacity_tokens: int, block_tokens: int = 16) -> KVPool:
        """A pool cut for this shape that holds at least `capacity_tokens` positions."""
        if int(capacity_tokens) <= 0:
            raise ValueError(f"capacity_tokens must be > 0, got {capacity_tokens}")
        blocks = -(-int(capacity_tokens) // int(block_tokens))
        return KVPool(blocks, block_tokens, self.bytes_per_token)

    def blocks_in(self, budget_bytes: int, block_tokens: int = 16) -> int:
        """How many blocks of `block_tokens` positions fit in `budget_bytes`."""
        return int(budget_bytes) // (int(block_tokens) * self.bytes_per_token)


def pool_rows(pool: KVPool, shape: KVShape) -> np.ndarray:
    """A view (no copy) of the pool's whole buffer as `[rows, layers, 2, kv_heads, head_dim]`."""
    if pool.bytes_per_token != shape.bytes_per_token:
        raise ValueError(
            f"pool has {pool.bytes_per_token} bytes per token, the model's KV needs "
            f"{shape.bytes_per_token} ({shape})"
        )
    rows = pool.num_blocks * pool.block_tokens
    return pool.buffer.view(np.dtype(shape.dtype)).reshape(rows, *shape.row_shape)


def token_rows(segments: Sequence[Segment], block_tokens: int) -> np.ndarray:
    """int64 row index (block * block_tokens + offset + i) of every position in `segments`, in order."""
    if not segments:
        return np.empty(0, dtype=np.int64)
    b, o, t = segments_to_arrays(segments)
    if (t < 0).any() or (o < 0).any() or (o + t > block_tokens).any():
        i = int(np.argmax((t < 0) | (o < 0) | (o + t > block_tokens)))
        raise ValueError(f"segment {i} {segments[i]} does not fit blocks of {block_tokens} tokens")
    starts = b * block_tokens + o
    total = int(t.sum())
    # each segment contributes starts[i], starts[i]+1, ...: a run-length arange
    seg_of = np.repeat(np.arange(len(t)), t)
    first = np.cumsum(t) - t
    return starts[seg_of] + (np.arange(total) - first[seg_of])
