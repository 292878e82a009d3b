"""The torch engine: a real transformers causal LM on the CPU, its KV in the worker's KVPool.

The pool holds every session's KV in the layout of `ampd.kv.layout` (token rows of
`[layers][k, v][kv_heads][head_dim]` fp32), so a remote prefill worker reads the history blocks and
writes the new blocks back over NIXL, and the engine on either side attends to exactly those bytes
(`ampd.engine.torch_kv.PoolCache`). The worker's block maps say where each session's KV is.

- prefill: one forward over the new tokens on top of the history gathered from the pool; the new
  KV lands in the segments the worker reserved; the next token per the request's `Sampling`. A
  Llama-family model prefills through `ampd.engine.torch_fast` too (`prefill_forward`: through
  transformers' forward a prefill of 2-3 tokens cost more than one of 4).
- decode_step: one forward for the whole batch, one new token per sequence (continuous batching:
  the worker may change the batch between any two steps). A Llama-family model decodes through
  `ampd.engine.torch_fast`: each decoding session's KV is also kept resident in attention's layout
  (read from the pool at the round's first step, appended to by each step, checked against its pool
  rows, dropped by `forget` when the round ends), and each sequence attends to its own KV with no
  padding. Other models pad the batch to the longest sequence, with position ids and a mask.

Greedy by default; temperature / top-p / seed per sequence (`ampd.engine.sampling`). The compute runs in a worker thread (torch releases the GIL), one forward at a time.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from ampd.engine.capabilities import TORCH
from ampd.engine.base import DecodeSeq, Sampling
from ampd.engine.sampling import next_tokens
from ampd.engine.torch_fast import Resident, decode_forward, fuse, prefill_forward, supports
from ampd.engine.torch_kv import PoolCache, attention_mask
from ampd.kv import KVPool, Segment, segments_tokens
from ampd.kv.layout import KVShape, pool_rows, token_rows

__all__ = ["TorchEngine", "kv_shape_of", "eos_ids_of"]


def kv_shape_of(config: Any) -> KVShape:
    """The per-token KV shape a transformers config implies (fp32)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVShape(int(config.num_hidden_layers), int(kv_heads), int(head_dim), "float32")


def eos_ids_of(model: Any) -> tuple[int, ...]:
    """The ids that end a turn: the generation config's eos ids, else the model config's."""
    out: list[int] = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None)
        for t in eos if isinstance(eos, (list, tuple)) else [eos]:
            if t is not None and int(t) not in out:
                out.append(int(t))
    return tuple(out)


class TorchEngine:
    """Engine protocol over one loaded model. `tp` is always 1 (one CPU process)."""

    name = "torch"
    capabilities = TORCH  # keeps_round_kv: a decoding round's resident KV (torch_fast)

    def __init__(self, model: Any, *, tp: int = 1) -> None:
        if tp != 1:
            raise ValueError(f"tp must be 1 for the torch engine, got {tp}")
        self.tp = 1
        self.model = model.eval()
        cfg = model.config
        self.kv_shape = kv_shape_of(cfg)
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = eos_ids_of(model)
        self._views: weakref.WeakKeyDictionary[KVPool, torch.Tensor] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        # Llama-family models decode through ampd.engine.torch_fast, over per-session resident KV
        self.fast = supports(model)
        self._fused = fuse(model) if self.fast else None  # fused projections, views shared with the model
        self._resident: weakref.WeakKeyDictionary[KVPool, dict[str, Resident]] = weakref.WeakKeyDictionary()

    @classmethod
    def from_pretrained(cls, path: str, **kw: Any) -> "TorchEngine":
        from ampd.engine.torch_models import load_model, resolve_model

        return cls(load_model(resolve_model(path)), **kw)

    # --- pools ----------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_shape.bytes_per_token

    def make_pool(self, capacity_tokens: int, block_tokens: int = 16) -> KVPool:
        """A pool cut for this model's KV, holding at least `capacity_tokens` positions."""
        return self.kv_shape.pool(capacity_tokens, block_tokens)

    def _rows(self, pool: KVPool) -> torch.Tensor:
        rows = self._views.get(pool)
        if rows is None:  # the buffer never moves, so one view serves the pool's whole life
            rows = torch.from_numpy(pool_rows(pool, self.kv_shape))
            self._views[pool] = rows
        return rows

    # --- checks ---------------------------------------------------------------------------------
    def check_tokens(self, token_ids: Sequence[int], field: str = "token_ids") -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64).reshape(-1))
        if ids.numel() == 0:
            raise ValueError(f"{field}: empty input")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"{field}[{i}] = {int(ids[i])} is outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    def check_context(self, tokens: int, field: str = "context") -> None:
        if tokens > self.max_context:
            raise ValueError(
                f"{field}: {tokens} tokens exceed the model's limit of {self.max_context}"
            )

    @staticmethod
    def _check_cover(segs: Sequence[Segment], tokens: int, field: str) -> None:
        got = segments_tokens(segs)
        if got != tokens:
            raise ValueError(f"{field}: segments cover {got} tokens, expected {tokens}")

    # --- compute (blocking) ---------------------------------------------------------------------
    def prefill_sync(
        self,
        pool: KVPool,
        token_ids: Sequence[int],
        history_kv: Sequence[Segment],
        new_kv: Sequence[Segment],
        sampling: Sampling | None = None,
    ) -> int:
        """KV of the new tokens into `new_kv` on top of the history at `history_kv`; next token."""
        ids = self.check_tokens(token_ids)
        l_hist, l_incr = segments_tokens(history_kv), int(ids.numel())
        self._check_cover(new_kv, l_incr, "new_kv")
        self.check_context(l_hist + l_incr)
        bt = pool.block_tokens
        hist_rows = token_rows(history_kv, bt)
        new_rows = token_rows(new_kv, bt)
        if self.fast:
            return self._prefill_fast(pool, ids, hist_rows, new_rows, sampling)
        read = torch.from_numpy(np.concatenate((hist_rows, new_rows)))[None]
        positions = torch.arange(l_hist, l_hist + l_incr)[None]
        mask = attention_mask(positions, torch.tensor([l_hist + l_incr]), l_hist + l_incr)
        cache = PoolCache(self._rows(pool), torch.from_numpy(new_rows)[None], read)
        logits = self._forward(ids[None], positions, mask, cache)
        return next_tokens(logits, [sampling], [l_hist + l_incr])[0]

    def _prefill_fast(self, pool: KVPool, ids: torch.Tensor, hist_rows: np.ndarray, new_rows: np.ndarray,
                       sampling: Sampling | None) -> int:
        """A Llama-family prefill through torch_fast, over the history read from the pool; the
        resident copy it builds is not kept (a prefill worker never decodes it)."""
        rows = self._rows(pool)
        l_hist, l_incr = len(hist_rows), int(ids.numel())
        res = Resident.from_pool(rows, hist_rows, l_incr)
        positions = torch.arange(l_hist, l_hist + l_incr)[None]
        with self._lock, torch.inference_mode():
            logits = prefill_forward(self.model, ids[None], positions, res, rows, new_rows, self._fused)
        return next_tokens(logits, [sampling], [l_hist + l_incr])[0]

    def forget(self, session_id: str) -> None:
        """Drops the session's resident KV (the decode worker calls it when a round ends): the next
        round's first step reads its KV from the pool again, where a prefill may have written."""
        for sessions in list(self._resident.values()):
            sessions.pop(session_id, None)

    def decode_sync(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        """One step for the batch: KV of each sequence's `position` into its kv_segments."""
        if not seqs:
            return []
        if self.fast:
            return self._decode_fast(pool, seqs)
        bt = pool.block_tokens
        ctx = [s.position + 1 for s in seqs]
        keys = max(ctx)
        read = np.empty((len(seqs), keys), dtype=np.int64)
        write = np.empty((len(seqs), 1), dtype=np.int64)
        for i, s in enumerate(seqs):
            self._check_cover(s.history_kv, s.position, f"seqs[{i}].history_kv")
            self._check_cover(s.kv_segments, 1, f"seqs[{i}].kv_segments")
            self.check_context(ctx[i], f"seqs[{i}].context")
            rows = np.concatenate((token_rows(s.history_kv, bt), token_rows(s.kv_segments, bt)))
            read[i, : ctx[i]] = rows
            read[i, ctx[i] :] = rows[0]  # padding: any valid row, the mask hides it
            write[i, 0] = rows[-1]
        ids = self.check_tokens([s.last_token for s in seqs], "last_token")[:, None]
        positions = torch.tensor([[s.position] for s in seqs])
        mask = attention_mask(positions, torch.tensor(ctx), keys)
        cache = PoolCache(self._rows(pool), torch.from_numpy(write), torch.from_numpy(read))
        logits = self._forward(ids, positions, mask, cache)
        return next_tokens(logits, [s.sampling for s in seqs], [s.position + 1 for s in seqs])

    def _decode_fast(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        bt = pool.block_tokens
        rows = self._rows(pool)
        kept = self._resident.setdefault(pool, {})
        res, write = [], np.empty(len(seqs), dtype=np.int64)
        for i, s in enumerate(seqs):
            self._check_cover(s.history_kv, s.position, f"seqs[{i}].history_kv")
            self._check_cover(s.kv_segments, 1, f"seqs[{i}].kv_segments")
            self.check_context(s.position + 1, f"seqs[{i}].context")
            hist = token_rows(s.history_kv, bt)
            r = kept.get(s.session_id)
            if r is None or not r.matches(hist):  # a new round, or rows that moved: read the pool
                r = kept[s.session_id] = Resident.from_pool(rows, hist, 1)
            res.append(r)
            write[i] = token_rows(s.kv_segments, bt)[0]
        ids = self.check_tokens([s.last_token for s in seqs], "last_token")[:, None]
        positions = torch.tensor([[s.position] for s in seqs])
        with self._lock, torch.inference_mode():
            logits = decode_forward(self.model, ids, positions, res, rows, write, self._fused)
        return next_tokens(logits, [s.sampling for s in seqs], [s.position + 1 for s in seqs])

    def _forward(self, ids, positions, mask, cache) -> torch.Tensor:
        """Last-position logits `[batch, vocab]`."""
        with self._lock, torch.inference_mode():
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1]

    # --- Engine protocol ------------------------------------------------------------------------
    async def prefill(
        self,
        session_id: str,
        l_hist: int,
        l_incr: int,
        pool: KVPool,
        new_kv: Sequence[Segment],
        *,
        token_ids: Sequence[int] | None = None,
        history_kv: Sequence[Segment] = (),
        sampling: Sampling | None = None,
    ) -> int:
        if token_ids is None:
            raise ValueError(f"session {session_id}: the torch engine needs token_ids")
        if len(token_ids) != l_incr:
            raise ValueError(f"token_ids: {len(token_ids)} tokens, l_incr is {l_incr}")
        self._check_cover(history_kv, l_hist, "history_kv")
        return await asyncio.to_thread(
            self.prefill_sync, pool, token_ids, history_kv, new_kv, sampling
        )

    async def decode_step(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        return await asyncio.to_thread(self.decode_sync, pool, list(seqs))

    async def pace_transfer(self, started: float, tokens: int, src_tp: int, dst_tp: int) -> None:
        """Real transfers take their real time: nothing to wait out."""
        del started, tokens, src_tp, dst_tp
        await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"TorchEngine({type(self.model).__name__}, kv={self.kv_shape})"
