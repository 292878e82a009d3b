"""The decode step and the prefill of a Llama-family model without transformers' per-step machinery.

Profiling the live decode worker (py-spy, torch.profiler) showed that, beside the weights, a step
through `model(...)` with `PoolCache` spent about a quarter of its time gathering every layer's whole
history out of the pool (a strided `index_select`, then a copy to make it contiguous) and in
attention over a padded, masked batch. This module runs the model's own weights and modules (norms,
projections, rotary embedding, MLP, head; q/k/v and gate/up fused into one product each, which gives
the same bits, `Fused`) layer by layer, so a lone session's decode step computes `generate`'s logits
exactly from the same KV, with attention over a per-session resident copy of the KV. A prefill runs
here too (`prefill_forward`), on the blocked weights from 2 tokens: the same values as transformers'
forward but for the last bits, and its greedy tokens are `generate`'s in the tests.

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

__all__ = ["Resident", "Fused", "PACK_FROM", "supports", "fuse", "decode_forward", "prefill_forward"]

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

    def make_room(self, n: int = 1) -> None:
        """Capacity for `n` more positions."""
        if self.tokens + n <= self.kv.shape[3]:
            return
        bigger = torch.empty(*self.kv.shape[:3], self.tokens + max(n, _GROW), self.kv.shape[4], dtype=self.kv.dtype)
        bigger[:, :, :, : self.tokens].copy_(self.kv[:, :, :, : self.tokens])
        self.kv = bigger


# Batches from this size multiply by oneDNN-blocked weights (Fused.pack). From 2, not 4: aten::mm of the
# 49152 x 576 head took 27-52 ms at 2 rows and 64-74 ms at 3 against 10 at 1 (oneDNN-blocked: 11 and 9;
# 2 threads, load 7-8), so a decode step of 2-3 sequences took twice one of 1 or 4 (100-145 ms against
# 50-55), a cost no non-decreasing D(batch) can fit (`ampd profile`'s held-out batch 3 was off by 42 %).
# With blocked weights from 2 on, steps of 1-4 sequences took 56-63 ms, in one process, alternating.
PACK_FROM = 2


@dataclass
class Fused:
    """A model's decode weights. Per layer, the q/k/v projections as one weight and the MLP's gate/up
    as one, so a step runs 2 matrix products where it ran 5 (each call has its fixed cost, large
    beside a 1-token product). The separate projections' weights become row views of the fused ones
    (no second copy: prefill through transformers reads the same memory). Concatenating along the
    output dimension leaves each output's dot product as it was: the same bits, so a batch of 1 still
    gives `generate`'s logits exactly (tests/unit/test_torch_engine.py).

    `packed`: the same weights reordered into oneDNN's blocked layout, used from PACK_FROM sequences
    on: from 2 rows on `aten::mm` runs these fp32 products far below the bandwidth limit on this
    project's CPU, the blocked layout faster (at batch 1 it is the slower one). Its sums are ordered
    differently; a batch's rows already differ from batch 1 in the last bits with `aten::mm` too
    (the exactness checks compare a batch's tokens with each sequence alone)."""

    qkv: list[torch.Tensor]
    split: tuple[int, int, int]
    gate_up: list[torch.Tensor]
    packed: list[tuple[torch.Tensor, ...]] | None = None  # per layer: qkv, o, gate_up, down
    head: torch.Tensor | None = None

    def pack(self, model: Any) -> None:
        """oneDNN-blocked copies of every product's weight (once, at the first large batch)."""
        if self.packed is not None or not torch.backends.mkldnn.is_available():
            return
        blocked = torch.ops.mkldnn._reorder_linear_weight
        layers = model.model.layers[: model.config.num_hidden_layers]
        self.packed = [tuple(blocked(w, 8) for w in (q, layer.self_attn.o_proj.weight, g, layer.mlp.down_proj.weight))
                       for q, g, layer in zip(self.qkv, self.gate_up, layers)]
        self.head = blocked(model.lm_head.weight, 8)


def fuse(model: Any) -> Fused | None:
    """The model's `Fused` weights; None (the separate modules run) for biased projections or another
    MLP than Llama's."""
    layers = model.model.layers[: model.config.num_hidden_layers]
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return None
        if any(lin.bias is not None for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj,
                                                mlp.up_proj, mlp.down_proj, model.lm_head)):
            return None
    a = layers[0].self_attn
    return Fused([_stack(la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj) for la in layers],
                 (a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features),
                 [_stack(la.mlp.gate_proj, la.mlp.up_proj) for la in layers])


def _stack(*linears: Any) -> torch.Tensor:
    w = torch.cat([lin.weight.detach() for lin in linears])
    at = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(w[at : at + n], requires_grad=False)
        at += n
    return w


def _blocked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with `w` in oneDNN's blocked layout (Fused.pack)."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), w, None, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def _rotary(model: Any):
    """The model module's own `apply_rotary_pos_emb` (the function its attention calls)."""
    return sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb


def decode_forward(model: Any, ids: torch.Tensor, positions: torch.Tensor, res: Sequence[Resident],
                   pool_rows: torch.Tensor, write_rows: np.ndarray, fused: Fused | None = None) -> torch.Tensor:
    """One decode step: `ids` and `positions` `[batch, 1]`, `res[b]` holding positions
    [0, positions[b]); appends each new token's KV to `res[b]` and writes it into pool row
    `write_rows[b]`. `fused`: `fuse(model)`'s weights (else the separate projections). Returns the
    logits `[batch, vocab]`."""
    return _forward(model, ids, positions, res, pool_rows, np.asarray(write_rows).reshape(-1, 1), fused)


def prefill_forward(model: Any, ids: torch.Tensor, positions: torch.Tensor, res: Resident,
                    pool_rows: torch.Tensor, write_rows: np.ndarray, fused: Fused | None = None) -> torch.Tensor:
    """A prefill of one sequence: `ids` and `positions` `[1, n]`, `res` holding the history
    [0, positions[0, 0]); the new tokens' KV goes to `res` and to pool rows `write_rows` `[n]`.
    Returns the last position's logits `[1, vocab]`.

    Why not transformers' forward: there a prefill of 2-3 new tokens multiplies with `aten::mm`'s slow
    2-3 row case (PACK_FROM), so it cost more than one of 4 (SmolLM2, no history, 1 thread: 77, 112,
    123, 112 ms for 1-4 tokens), a cost no non-decreasing prefill piece fits (`ampd profile`'s
    held-out `l_incr` 2 was off by 25-31 %). Here, on the blocked weights from 2 tokens: 69, 73, 86,
    89 ms, 16 tokens 119 against 151, 128 tokens 300 against 371 (2 threads), and at par from 256
    to 1,024 tokens. Greedy tokens stay `generate`'s (tests/unit/test_torch_engine.py)."""
    return _forward(model, ids, positions, [res], pool_rows, np.asarray(write_rows).reshape(1, -1), fused)


def _forward(model: Any, ids: torch.Tensor, positions: torch.Tensor, res: Sequence[Resident],
             pool_rows: torch.Tensor, write_rows: np.ndarray, fused: Fused | None) -> torch.Tensor:
    """`ids`, `positions` and `write_rows` `[batch, n]`: n new tokens per sequence, each attending
    causally to its sequence's resident KV and the new tokens before it."""
    inner = model.model
    rope = _rotary(model)
    b, n_new = ids.shape
    packed = None
    if fused is not None and b * n_new >= PACK_FROM:
        fused.pack(model)
        packed = fused.packed
    for r in res:
        r.make_room(n_new)
    # new token j of a sequence holding n positions sees keys [0, n + j]: a mask only when n_new > 1
    masks = [None if n_new == 1 else torch.ones(n_new, r.tokens + n_new, dtype=torch.bool).tril(r.tokens)
             for r in res]
    h = inner.embed_tokens(ids)  # [b, n_new, hidden]
    cos, sin = inner.rotary_emb(h, positions)
    at = [r.tokens for r in res]
    for li, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (b, n_new, -1, attn.head_dim)
        if packed:
            q, k, v = _blocked(x, packed[li][0]).split(fused.split, -1)
        elif fused is not None:
            q, k, v = F.linear(x, fused.qkv[li]).split(fused.split, -1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.reshape(shape).transpose(1, 2)  # [b, heads, n_new, dim]
        k = k.reshape(shape).transpose(1, 2)  # [b, kv_heads, n_new, dim]
        v = v.reshape(shape).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        outs = []
        for i, r in enumerate(res):
            n, end = at[i], at[i] + n_new
            layer_kv = r.kv[li]  # [2, kv_heads, capacity, dim]
            layer_kv[0, :, n:end] = k[i]
            layer_kv[1, :, n:end] = v[i]
            outs.append(F.scaled_dot_product_attention(
                q[i : i + 1], layer_kv[0, None, :, :end], layer_kv[1, None, :, :end],
                attn_mask=masks[i], scale=attn.scaling, enable_gqa=True))
        o = outs[0] if b == 1 else torch.cat(outs)  # [b, heads, n_new, dim]
        o = o.transpose(1, 2).reshape(b, n_new, -1)
        h = h + (_blocked(o, packed[li][1]) if packed else attn.o_proj(o))
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        if packed:  # LlamaMLP's down(act(gate(x)) * up(x)), gate and up in one product
            gate, up = _blocked(x, packed[li][2]).chunk(2, -1)
            h = h + _blocked(mlp.act_fn(gate) * up, packed[li][3])
        elif fused is not None:
            gate, up = F.linear(x, fused.gate_up[li]).chunk(2, -1)
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)
        else:
            h = h + mlp(x)
    h = inner.norm(h)[:, -1]
    logits = _blocked(h, fused.head) if packed else model.lm_head(h)
    for i, r in enumerate(res):  # the pool gets the new KV too: it stays the KV's home
        new = write_rows[i]
        pool_rows[torch.from_numpy(np.ascontiguousarray(new, dtype=np.int64))] = \
            r.kv[:, :, :, at[i] : at[i] + n_new].permute(3, 0, 1, 2, 4)
        r.rows = np.concatenate((r.rows, new))
        r.tokens += n_new
    return logits
