"""The sglang engine: an SGLang runtime (`sglang.Engine`, in-process API) behind the Engine protocol.
Runs on the CPU (`make test-sglang`, tests/sglang/) and is written for a GPU (docs/engines.md says
what ran where).

SGLang owns the KV (its paged pool and radix cache) and batches the requests itself. The worker's
KVPool only does AMPD's admission accounting; its bytes are not the model's KV. Every request
sends the session's whole context as token ids: SGLang's radix cache matches the history, so only
the new tokens are computed.

- A round decodes as ONE streaming request (`streams_rounds`): started by a local prefill
  (`prefill(..., stops=...)`: the round's request, its first chunk is the first token) or, after a
  remote prefill, by `open_round` on the context plus the first token. SGLang streams one token per
  chunk (`incremental_streaming_output`) and stops where the round's `RoundStops` say; `decode_step`
  hands each round's next token to the worker, which still decides where the round ends and calls
  `end_round` (aborting the request when it stopped first, e.g. on a stop string).
- `prefill` without stops (a prefill worker's round, a chunk of a local one, the profiler) is one
  request with `max_new_tokens=1`; its output is the round's first token.
- KV between instances (a remote prefill on top of the history the decode instance holds, and the
  decode instance continuing without recomputing it) goes through SGLang's unified cache external
  linker (`ampd.engine.sglang_linker`), when configured.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import structlog

from ampd.engine.capabilities import SGLANG
from ampd.engine.base import DecodeSeq, RoundStops, Sampling
from ampd.engine.sglang_args import SGLangOptions, launch_env, require_sglang, sampling_params, server_args
from ampd.kv import KVPool, Segment

__all__ = ["SGLangEngine"]

log = structlog.get_logger()
_END = object()  # the round's request ended (SGLang's stop, or aborted)


@dataclass(eq=False)
class _Round:
    """One round's streaming request and the tokens it produced that the worker has not taken yet."""

    rid: str
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)  # ints, then _END or an exception
    task: asyncio.Task | None = None
    cached_tokens: int = 0  # SGLang's count of the request's prefix taken from its caches
    prompt_tokens: int = 0


class SGLangEngine:
    name = "sglang"
    # needs_token_ids: workers pass every session's ids (DecodeSeq.token_ids, history_ids);
    # streams_rounds: one request per round (module doc)
    capabilities = SGLANG

    def __init__(self, runtime: Any, *, tp: int, vocab_size: int, max_context: int,
                 eos_token_ids: tuple[int, ...], kv_bytes_per_token: int) -> None:
        self.runtime = runtime  # a sglang.Engine, or anything with its async_generate and abort
        self.tp = tp
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.eos_token_ids = eos_token_ids
        self.kv_bytes_per_token = kv_bytes_per_token
        self._ids: dict[str, list[int]] = {}  # each session's tokens this engine knows, in order
        self._rounds: dict[str, _Round] = {}  # each session's open round
        self._rid = itertools.count()
        # per request: (session, prompt tokens, tokens SGLang took from its caches); the last ones
        self.requests: list[tuple[str, int, int]] = []

    @classmethod
    def launch(cls, options: SGLangOptions) -> "SGLangEngine":
        """Starts an SGLang instance for `options` (EngineUnavailable without SGLang installed)."""
        os.environ.update(launch_env(options))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, GenerationConfig

        sglang = require_sglang()
        cfg = AutoConfig.from_pretrained(options.model_path, local_files_only=True)
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        elem = 4 if options.dtype == "float32" else 2
        try:
            gen = GenerationConfig.from_pretrained(options.model_path, local_files_only=True)
        except OSError:
            gen = None
        eos: list[int] = []  # the generation config's eos ids, then the model config's (as the torch engine)
        for c in (gen, cfg):
            e = getattr(c, "eos_token_id", None)
            eos += [int(t) for t in (e if isinstance(e, (list, tuple)) else [e]) if t is not None and int(t) not in eos]
        runtime = sglang.Engine(**server_args(options))
        # SGLang installs its SIGTERM/SIGQUIT handlers on this loop when it first serves a request;
        # doing it now lets the worker's own handlers (installed after the engine) stay in force.
        try:
            asyncio.get_running_loop()
            runtime.tokenizer_manager.auto_create_handle_loop()
        except RuntimeError:
            pass  # no running loop (a script): SGLang makes its own on the first request
        return cls(runtime, tp=options.tp, vocab_size=int(cfg.vocab_size),
                   max_context=int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30),
                   eos_token_ids=tuple(eos),
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
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field}[{bad}] = {ids[bad]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_context:
            raise ValueError(f"{field}: {len(ids)} tokens exceed the model's limit of {self.max_context}")

    def _note(self, session_id: str, meta: dict) -> None:
        """What SGLang reported of one request's prefix reuse (tests and the profiler read it)."""
        prompt, cached = int(meta.get("prompt_tokens", 0)), int(meta.get("cached_tokens", 0) or 0)
        self.requests.append((session_id, prompt, cached))
        del self.requests[:-256]
        log.info("sglang request", session=session_id, prompt_tokens=prompt, cached_tokens=cached)

    # --- rounds ---------------------------------------------------------------------------------
    def _start(self, session_id: str, ids: list[int], sampling: Sampling | None, stops: RoundStops,
               produced: int) -> _Round:
        """Starts the round's streaming request on `ids` for the rest of the round (`produced` of
        its tokens are made already); its tokens go to the round's queue."""
        self.end_round(session_id)
        r = _Round(rid=f"{session_id}#{next(self._rid)}")
        params = sampling_params(sampling, stops.max_tokens - produced, len(ids), stops)
        r.task = asyncio.ensure_future(self._pump(session_id, r, ids, params))
        self._rounds[session_id] = r
        return r

    async def _pump(self, session_id: str, r: _Round, ids: list[int], params: dict) -> None:
        meta: dict = {}
        try:
            stream = await self.runtime.async_generate(input_ids=ids, sampling_params=params, rid=r.rid, stream=True)
            async for chunk in stream:
                meta = chunk.get("meta_info", meta)
                for tok in chunk.get("output_ids", ()):
                    r.tokens.put_nowait(int(tok))
            r.tokens.put_nowait(_END)
        except asyncio.CancelledError:
            r.tokens.put_nowait(_END)
            raise
        except Exception as exc:  # SGLang's error reaches the worker at its next decode step
            r.tokens.put_nowait(exc)
        finally:
            if meta:
                r.prompt_tokens, r.cached_tokens = int(meta.get("prompt_tokens", 0)), int(meta.get("cached_tokens", 0) or 0)
                self._note(session_id, meta)

    async def _next(self, session_id: str) -> int:
        r = self._rounds.get(session_id)
        if r is None:
            raise RuntimeError(f"session {session_id}: no round is open on the sglang engine")
        tok = await r.tokens.get()
        if tok is _END:
            raise RuntimeError(f"session {session_id}: SGLang ended the round before AMPD's stop")
        if isinstance(tok, BaseException):
            raise tok
        self._ids[session_id].append(tok)
        return tok

    def open_round(self, session_id: str, token_ids: Sequence[int], sampling: Sampling | None,
                   stops: RoundStops) -> None:
        """The round's first token came from a remote prefill (it ends `token_ids`, the session's
        whole context): SGLang decodes the rest of the round as one request from here."""
        ids = list(token_ids)
        self._check(ids, "token_ids")
        self._ids[session_id] = list(ids)
        self._start(session_id, ids, sampling, stops, produced=1)

    def end_round(self, session_id: str) -> None:
        """The worker ended the session's round: its request stops if SGLang has not stopped it."""
        r = self._rounds.pop(session_id, None)
        if r is not None and r.task is not None and not r.task.done():
            self.runtime.tokenizer_manager.abort_request(r.rid)
            r.task.cancel()

    # --- Engine protocol ------------------------------------------------------------------------
    async def prefill(self, session_id: str, l_hist: int, l_incr: int, pool: KVPool, new_kv: Sequence[Segment],
                      *, token_ids: Sequence[int] | None = None, history_kv: Sequence[Segment] = (),
                      sampling: Sampling | None = None, history_ids: Sequence[int] | None = None,
                      stops: RoundStops | None = None) -> int:
        """The round's first token. With `stops` (the last piece of a local prefill on the decode
        worker) the request goes on to decode the whole round; without, it makes that token only."""
        del pool, new_kv, history_kv  # SGLang keeps the KV (module doc)
        if token_ids is None or len(token_ids) != l_incr:
            raise ValueError(f"token_ids: the sglang engine needs the round's {l_incr} input tokens")
        ids = self._context(session_id, l_hist, history_ids) + list(token_ids)
        self._check(ids, "token_ids")
        self._ids[session_id] = list(ids)
        if stops is not None:
            self._start(session_id, ids, sampling, stops, produced=0)
            return await self._next(session_id)
        out = await self.runtime.async_generate(
            input_ids=ids, sampling_params=sampling_params(sampling, 1, len(ids)), rid=f"{session_id}#{next(self._rid)}")
        self._note(session_id, out.get("meta_info", {}))
        tok = int(out["output_ids"][-1])
        self._ids[session_id].append(tok)
        return tok

    async def decode_step(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        """Each sequence's next token from its round's request; SGLang batched them itself."""
        del pool
        return list(await asyncio.gather(*(self._next(s.session_id) for s in seqs)))

    async def pace_transfer(self, started: float, tokens: int, src_tp: int, dst_tp: int) -> None:
        del started, tokens, src_tp, dst_tp  # real transfers take their real time
        await asyncio.sleep(0)

    def forget(self, session_id: str) -> None:
        """The session ended on this worker: its round stops, its ids go (SGLang's caches evict its
        KV by LRU)."""
        self.end_round(session_id)
        self._ids.pop(session_id, None)

    def shutdown(self) -> None:
        for sid in list(self._rounds):
            self.end_round(sid)
        self.runtime.shutdown()
