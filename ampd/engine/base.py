"""The Engine protocol every backend (mock, torch, sglang) implements for the workers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ampd.kv import KVPool, Segment


@dataclass(frozen=True, slots=True)
class Sampling:
    """How an engine picks each output token; greedy when temperature is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


GREEDY = Sampling()


@dataclass(slots=True)
class DecodeSeq:
    """One sequence in a decode step: its last token sits at `position` and has no KV yet."""

    session_id: str
    position: int
    last_token: int
    kv_segments: list[Segment]  # where the KV of `position` goes (reserved by the worker)
    context_tokens: int  # tokens whose KV the step reads (position + 1)
    # Where the KV of positions [0, position) lies in the pool. An engine that computes attention
    # (torch) reads it; the mock needs none, so workers that only drive the mock may leave it empty.
    history_kv: list[Segment] = field(default_factory=list)
    sampling: Sampling | None = None


class Engine(Protocol):
    name: str
    tp: int
    vocab_size: int
    max_context: int  # tokens of one sequence (input and output)
    eos_token_ids: tuple[int, ...]

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
        """Computes the KV of positions [l_hist, l_hist + l_incr) into `new_kv` (the history is
        already in the pool, at `history_kv`) and returns the first output token (position
        l_hist + l_incr). `token_ids` are the l_incr new input tokens: a real engine needs them and
        the history's segments; the mock derives everything from (session, position)."""
        ...

    async def decode_step(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        """One step for the batch: writes each sequence's KV at `position`, returns next tokens."""
        ...

    async def pace_transfer(self, started: float, tokens: int, src_tp: int, dst_tp: int) -> None:
        """Waits out the modelled KV transfer time beyond what the real transfer took (mock only)."""
        ...
