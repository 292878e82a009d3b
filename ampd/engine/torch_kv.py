"""Attention over KV that lives in a KVPool: a transformers cache backed by pool rows, and its mask.

The model's attention layers call `cache.update(keys, values, layer)` with the new tokens' keys and
values. `PoolCache` writes them straight into their pool rows (the blocks the worker reserved, the
same bytes NIXL moves) and answers with the keys and values of the whole context gathered from the
pool, padded to the longest sequence of the batch. So the pool is the only home of a session's KV:
whatever a remote prefill wrote there is what the next step attends to, and nothing else has to be
kept in sync. The gather per layer and step is the price; transformers' own DynamicCache pays about
the same by concatenating the whole cache at every step.

Positions sit left-aligned: key index k of sequence b is position k, so one boolean mask
`k <= position(query) and k < context(b)` covers causal prefill on top of history and batched
decode of unequal lengths alike.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PoolCache", "attention_mask"]


class PoolCache:
    """The cache object one forward pass uses; built per pass, never kept.

    rows:       the pool as a tensor view `[rows, layers, 2, kv_heads, head_dim]` (shares memory).
    write_rows: `[batch, q]` pool row of each new token (the positions this pass computes).
    read_rows:  `[batch, keys]` pool row of each context position, padded with any valid row.
    """

    is_compileable = False
    is_sliding = [False]

    def __init__(self, rows: torch.Tensor, write_rows: torch.Tensor, read_rows: torch.Tensor):
        self.rows = rows
        self._write = write_rows.reshape(-1)
        self._read = read_rows.reshape(-1)
        self._batch, self._keys = read_rows.shape

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, q, d = key_states.shape
        layer = self.rows[:, layer_idx]  # [rows, 2, kv_heads, head_dim], strided view
        new = torch.stack((key_states, value_states), dim=1)  # [b, 2, h, q, d]
        layer[self._write] = new.permute(0, 3, 1, 2, 4).reshape(b * q, 2, h, d)
        got = layer.index_select(0, self._read)  # [b * keys, 2, h, d]
        kv = got.view(self._batch, self._keys, 2, h, d).permute(2, 0, 3, 1, 4).contiguous()
        return kv[0], kv[1]  # each [b, h, keys, d]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._keys


def attention_mask(query_positions: torch.Tensor, context: torch.Tensor, keys: int) -> torch.Tensor:
    """Boolean `[batch, 1, q, keys]`: query j of sequence b sees key k when k <= its position and
    k < context[b] (padding beyond a shorter sequence's context is never seen)."""
    k = torch.arange(keys)
    causal = k[None, None, :] <= query_positions[:, :, None]
    inside = k[None, None, :] < context[:, None, None]
    return (causal & inside)[:, None]
