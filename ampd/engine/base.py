"""The Engine protocol every backend (mock, torch, sglang) implements for the workers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ampd.engine.capabilities import EngineCapabilities
from ampd.kv import KVPool, Segment


@dataclass(frozen=True, slots=True)
class Sampling:
    """How an engine picks each output token. Greedy (argmax) when temperature == 0.

    A seeded request is reproducible: the randomness of the token at position p is a function of
    (seed, p) only, so the tokens do not depend on batch composition or on which worker (local or
    remote prefill) produced the round's first token. seed None draws fresh randomness."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@dataclass(slots=True)
class DecodeSeq:
    """One sequence in a decode step: its last token sits at `position` and has no KV yet."""

    session_id: str
    position: int
    last_token: int
    kv_segments: list[Segment]  # where the KV of `position` goes (reserved by the worker)
    context_tokens: int  # tokens whose KV the step reads (position + 1)
    # Where the KV of positions [0, position) lies in the pool. An engine with capability
    # `reads_history_kv` (torch) reads it; workers leave it empty for the others.
    history_kv: list[Segment] = field(default_factory=list)
    sampling: Sampling | None = None  # None: greedy
    # The session's token ids, at least up to `position` (the worker's own list, not a copy). Only an
    # engine with capability `needs_token_ids` (sglang: it resends the context, its prefix cache matches) reads
    # them; workers leave it empty for the others.
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class RoundStops:
    """Where a round ends, for an engine that decodes a whole round as one request
    (`streams_rounds`): the worker still decides every stop itself (and ends the engine's round
    where it stops first: stop strings, a client's StopRound); the engine's request must not end
    before the worker's. `max_tokens` counts the round's output tokens, its first included."""

    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()  # the client's stop ids, and the model's eos unless ignored
    ignore_eos: bool = True  # no stop id ends the round: only max_tokens (or the worker)


def round_stops(max_tokens: int, stop_token_ids: Sequence[int], ignore_eos: bool,
                eos_token_ids: Sequence[int]) -> RoundStops:
    """The stops of a round whose request samples `max_tokens` tokens at most (the decode worker's
    `Session.finish` rule: a client stop id, or the model's eos unless `ignore_eos`)."""
    ids = tuple(dict.fromkeys([*stop_token_ids, *(() if ignore_eos else eos_token_ids)]))
    return RoundStops(max_tokens, ids, ignore_eos=not ids)


class Engine(Protocol):
    """What the workers drive. The calls below every engine has; ``capabilities`` declares the rest
    (ampd.engine.capabilities.EngineCapabilities), and with it the calls an engine adds:
    ``forget(session_id)`` (needs_token_ids, keeps_round_kv), ``open_round`` / ``end_round``
    (streams_rounds: the decode worker gives a local prefill the round's `RoundStops`
    (`prefill(..., stops=...)`), calls `open_round` after a remote prefill's first token and
    `end_round` when it ends a round; `decode_step` hands out each round's next token;
    services/decode/streamed.py), ``make_pool`` (cuts_pool) and ``kv_bytes_per_token``
    (model_kv_bytes). Callers read the declaration, never the engine's name."""

    name: str
    capabilities: EngineCapabilities
    tp: int
    # Token ids that end a round by themselves (the model's end of turn); empty for the mock,
    # whose rounds end only at max_tokens or a stop the client set.
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # input ids must lie in [0, vocab_size)
    max_context: int  # the most positions one session may hold

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
        prefix_tokens: int = 0,
    ) -> int:
        """Computes the KV of positions [l_hist, l_hist + l_incr) into `new_kv` (the history is
        already in the pool, at `history_kv`) and returns the first output token (position
        l_hist + l_incr), picked with `sampling` (None: greedy). `token_ids` are the l_incr new
        input tokens: a real engine needs them and the history's segments; the mock derives
        everything from (session, position). ``prefix_tokens`` (passed only to an engine with
        ``patterned_kv``): the session's leading positions in prefix blocks, whose KV pattern is
        keyed by position alone (ampd.kv.pattern)."""
        ...

    async def decode_step(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        """One step for the batch: writes each sequence's KV at `position`, returns next tokens
        (the token at `position + 1`, picked with each sequence's `sampling`)."""
        ...

    async def pace_transfer(self, started: float, tokens: int, src_tp: int, dst_tp: int) -> None:
        """Waits out the modelled KV transfer time beyond what the real transfer took (mock only)."""
        ...
