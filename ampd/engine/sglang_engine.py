"""The sglang engine: SGLang's runtime on a GPU behind the Engine protocol. Written against SGLang's
documented offline API (`sglang.Engine`, `async_generate`); it has NOT run: AMPD's machines have
no GPU (docs/engines.md says what ran and what did not).

SGLang owns the KV (its paged GPU pool, radix tree, host tier and NIXL storage tier; see
`ampd.engine.sglang_args` for why KV moves between workers through HiCache storage on NIXL) and
its own continuous batching. The worker's KVPool still does AMPD's admission accounting; its bytes
are not the model's KV. Every call resends the session's token ids and SGLang's prefix cache
matches the history, so only new tokens are computed:

- prefill: one request with the whole context and `max_new_tokens=1`; its output is the round's
  first token.
- decode_step: one such request per sequence of the batch, all in flight at once, so SGLang's
  scheduler runs them as one batch; each is a prefix-cache hit up to its last token.

The engine needs each session's token ids. The decode worker gives them with every step
(`DecodeSeq.token_ids`) and the prefill task carries the history's ids (`history_ids`); the engine
also remembers what it saw, so a worker that gives ids only once still works.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Sequence

from ampd.engine.base import DecodeSeq, Sampling
from ampd.engine.sglang_args import SGLangOptions, require_sglang, sampling_params, server_args, storage_env
from ampd.kv import KVPool, Segment

__all__ = ["SGLangEngine"]


class SGLangEngine:
    name = "sglang"
    needs_token_ids = True  # workers pass every session's ids (DecodeSeq.token_ids, history_ids)

    def __init__(self, runtime: Any, *, tp: int, vocab_size: int, max_context: int,
                 eos_token_ids: tuple[int, ...], kv_bytes_per_token: int) -> None:
        self.runtime = runtime  # a sglang.Engine, or anything with its async_generate
        self.tp = tp
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.eos_token_ids = eos_token_ids
        self.kv_bytes_per_token = kv_bytes_per_token
        self._ids: dict[str, list[int]] = {}  # each session's tokens this engine knows, in order
        self._rid = itertools.count()

    @classmethod
    def launch(cls, options: SGLangOptions) -> "SGLangEngine":
        """Starts an SGLang instance for `options` (EngineUnavailable without the extra)."""
        import os

        from transformers import AutoConfig

        sglang = require_sglang()
        os.environ.update(storage_env(options))  # the instance's processes inherit it
        cfg = AutoConfig.from_pretrained(options.model_path)
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        elem = 2  # bf16/fp16 KV, SGLang's default on a GPU
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        return cls(sglang.Engine(**server_args(options)), tp=options.tp, vocab_size=int(cfg.vocab_size),
                   max_context=int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30),
                   eos_token_ids=tuple(int(t) for t in eos if t is not None),
                   kv_bytes_per_token=2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * elem)

    # --- token ids ------------------------------------------------------------------------------
    def _context(self, session_id: str, n: int, given: Sequence[int] | None) -> list[int]:
        """The session's first `n` token ids: from `given` when the worker passed them, else from
        what this engine saw."""
        if given is not None and len(given) >= n:
            ids = list(given[:n])
            self._ids[session_id] = ids
            return list(ids)
        known = self._ids.get(session_id, [])
        if len(known) < n:
            raise ValueError(f"session {session_id}: the engine knows {len(known)} of its {n} history "
                             "tokens; the worker must pass the session's token ids")
        del known[n:]  # a rewound session (keep_tokens) drops its tail
        return list(known)

    def _check(self, ids: Sequence[int], field: str) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_context:
            raise ValueError(f"{field}: {len(ids)} tokens exceed the model's limit of {self.max_context}")

    async def _next_token(self, session_id: str, ids: list[int], sampling: Sampling | None) -> int:
        out = await self.runtime.async_generate(
            input_ids=ids, sampling_params=sampling_params(sampling, 1, len(ids)), rid=f"{session_id}#{next(self._rid)}")
        tok = int(out["output_ids"][-1])
        self._ids[session_id] = ids + [tok]
        return tok

    # --- Engine protocol ------------------------------------------------------------------------
    async def prefill(self, session_id: str, l_hist: int, l_incr: int, pool: KVPool, new_kv: Sequence[Segment],
                      *, token_ids: Sequence[int] | None = None, history_kv: Sequence[Segment] = (),
                      sampling: Sampling | None = None, history_ids: Sequence[int] | None = None) -> int:
        del pool, new_kv, history_kv  # SGLang keeps the KV (module doc)
        if token_ids is None or len(token_ids) != l_incr:
            raise ValueError(f"token_ids: the sglang engine needs the round's {l_incr} input tokens")
        ids = self._context(session_id, l_hist, history_ids) + list(token_ids)
        self._check(ids, "token_ids")
        return await self._next_token(session_id, ids, sampling)

    async def decode_step(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        del pool
        contexts = []
        for i, s in enumerate(seqs):
            ids = self._context(s.session_id, s.position, s.token_ids or None) + [s.last_token]
            self._check(ids, f"seqs[{i}].token_ids")
            contexts.append(ids)
        return list(await asyncio.gather(*(self._next_token(s.session_id, ids, s.sampling)
                                           for s, ids in zip(seqs, contexts))))

    async def pace_transfer(self, started: float, tokens: int, src_tp: int, dst_tp: int) -> None:
        del started, tokens, src_tp, dst_tp  # real transfers take their real time
        await asyncio.sleep(0)

    def forget(self, session_id: str) -> None:
        """The session ended on this worker: drop its ids (SGLang's caches evict its KV by LRU)."""
        self._ids.pop(session_id, None)

    def shutdown(self) -> None:
        self.runtime.shutdown()
