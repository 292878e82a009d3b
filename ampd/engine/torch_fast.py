"""The decode step of a Llama-family model without transformers' per-step machinery.

Profiling the live decode worker (py-spy, torch.profiler) showed that, beside the weights, a step
through `model(...)` with `PoolCache` spent about a quarter of its time gathering every layer's whole
history out of the pool (a strided `index_select`, then a copy to make it contiguous) and in
attention over a padded, masked batch. This module runs the same modules of the model (norms,
projections, rotary embedding, MLP, head: the same kernels on the same shapes, so the same bits as
`generate`) layer by layer, with attention over a per-session resident copy of the KV:

- `Resident`: a session's KV as `[layers, k/v, kv_heads, capacity, head_dim]`, the layout attention
  reads. Built from the pool at the first step of a decode (one gather per round, not per step and
  layer), then appended to by each step. The pool stays the home of the KV: every step writes the
  new token's KV into its pool row too, and the resident copy is checked against the pool rows it
  came from at every step (a session whose rows changed is rebuilt from the pool). The decode
  worker drops a session's copy when its round ends (`TorchEngine.forget`), so KV written into the
  pool between rounds (a remote prefill over NIXL, a rewind) is always read from the pool.
- Attention per sequence: each sequence attends to its own resident KV with no padding and no mask,
  the call `generate` makes at batch 1 (grouped-query SDPA); the projections and the MLP run once
  for the whole batch, so the weights are read once per step whatever the batch.

Only models whose layers have Llama's shape take this path (`supports`); any other transformers
model decodes through `PoolCache`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Resident", "supports", "decode_forward"]

_GROW = 256  # resident capacity grows by this many positions at least (amortizes the copy)


def supports(model: Any) -> bool:
    """A causal LM built like Llama: model.model.{embed_tokens, layers, norm, rotary_emb}, lm_head,
    layers of self_attn.{q,k,v,o}_proj with an MLP and two RMS norms, nothing else per layer."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if getattr(model.config, "model_type", "") != "llama" or not layers or not hasattr(model, "lm_head"):
        return False
    if not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "rotary_emb")):
        return False
    a = layers[0].self_attn
    return all(hasattr(a, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))


@dataclass
class Resident:
    """One session's KV in attention's layout; valid for positions [0, tokens)."""

    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    rows: np.ndarray  # the pool row of each position [0, tokens): where it came from
    tokens: int

    @classmethod
    def from_pool(cls, pool_rows: torch.Tensor, rows: np.ndarray, extra: int) -> "Resident":
        """The KV of `rows` gathered from the pool, with room for `extra` more positions."""
        n = len(rows)
        layers, _, heads, dim = pool_rows.shape[1:]
        kv = torch.empty(layers, 2, heads, n + max(extra, _GROW), dim, dtype=pool_rows.dtype)
        if n:
            got = pool_rows.index_select(0, torch.from_numpy(rows))  # [n, layers, 2, heads, dim]
            kv[:, :, :, :n].copy_(got.permute(1, 2, 3, 0, 4))
        return cls(kv, rows.copy(), n)

    def matches(self, rows: np.ndarray) -> bool:
        return len(rows) == self.tokens and np.array_equal(rows, self.rows)

    def make_room(self) -> None:
        if self.tokens < self.kv.shape[3]:
            return
        bigger = torch.empty(*self.kv.shape[:3], self.tokens + _GROW, self.kv.shape[4], dtype=self.kv.dtype)
        bigger[:, :, :, : self.tokens].copy_(self.kv[:, :, :, : self.tokens])
        self.kv = bigger


def _rotary(model: Any):
    """The model module's own `apply_rotary_pos_emb` (the function its attention calls)."""
    return sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb


def decode_forward(model: Any, ids: torch.Tensor, positions: torch.Tensor, res: Sequence[Resident],
                   pool_rows: torch.Tensor, write_rows: np.ndarray) -> torch.Tensor:
    """One decode step: `ids` and `positions` `[batch, 1]`, `res[b]` holding positions
    [0, positions[b]); appends each new token's KV to `res[b]` and writes it into pool row
    `write_rows[b]`. Returns the logits `[batch, vocab]`."""
    inner = model.model
    rope = _rotary(model)
    b = ids.shape[0]
    for r in res:
        r.make_room()
    h = inner.embed_tokens(ids)  # [b, 1, hidden]
    cos, sin = inner.rotary_emb(h, positions)
    at = [r.tokens for r in res]
    for li, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (b, 1, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)  # [b, heads, 1, dim]
        k = attn.k_proj(x).view(shape).transpose(1, 2)  # [b, kv_heads, 1, dim]
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        outs = []
        for i, r in enumerate(res):
            n = at[i]
            layer_kv = r.kv[li]  # [2, kv_heads, capacity, dim]
            layer_kv[0, :, n] = k[i, :, 0]
            layer_kv[1, :, n] = v[i, :, 0]
            outs.append(F.scaled_dot_product_attention(
                q[i : i + 1], layer_kv[0, None, :, : n + 1], layer_kv[1, None, :, : n + 1],
                scale=attn.scaling, enable_gqa=True))
        o = outs[0] if b == 1 else torch.cat(outs)  # [b, heads, 1, dim]
        o = o.transpose(1, 2).reshape(b, 1, -1)
        h = h + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = inner.norm(h)
    logits = model.lm_head(h[:, -1])
    for i, r in enumerate(res):  # the pool gets the new KV too: it stays the KV's home
        pool_rows[int(write_rows[i])] = r.kv[:, :, :, at[i]]
        r.rows = np.append(r.rows, write_rows[i])
        r.tokens += 1
    return logits
