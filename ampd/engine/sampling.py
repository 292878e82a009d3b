"""Picking the next token from logits: greedy, or temperature / top-p sampling with a seed.

One uniform number per token decides a sampled token (inverse CDF over the kept distribution).
For a seeded request that number is a hash of (seed, position), not the state of a generator
that advances with each call: the token at a position is then the same whether the round's
first token came from a local or a remote prefill, whichever batch the step ran in, and after
the session moved between workers. Everything here is pure except `uniform` for seed None.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from ampd.engine.base import Sampling

__all__ = ["uniform", "sample_row", "next_tokens"]

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64 bits with good avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int | None, position: int) -> float:
    """A number in [0, 1) for the token at `position`: a function of (seed, position) when
    seeded, fresh randomness when seed is None."""
    if seed is None:
        return random.random()
    x = _mix64((_mix64(seed & _M64) + (position & _M64) * 0x9E3779B97F4A7C15) & _M64)
    return (x >> 11) * (1.0 / (1 << 53))  # 53 random bits: every value a float64 holds exactly


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, u: float) -> int:
    """The token `u` selects from softmax(logits / temperature) cut to its top-p nucleus.

    `logits` is one row `[vocab]`. Computed in float64, with a stable sort, so that the same
    logits and u give the same token everywhere."""
    if temperature == 0:
        return int(logits.argmax())
    x = logits.double() / temperature
    if top_p < 1:
        x, order = torch.sort(x, descending=True, stable=True)
    probs = torch.softmax(x, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    if top_p < 1:
        # the smallest prefix whose mass reaches top_p (always at least the top token)
        kept = max(1, int(((cum - probs) < top_p).sum()))
        cum = cum[:kept]
    i = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=cum.dtype), right=True))
    i = min(i, cum.numel() - 1)  # u * total can round onto the last edge
    return int(order[i]) if top_p < 1 else i


def next_tokens(
    logits: torch.Tensor, samplings: Sequence[Sampling | None], positions: Sequence[int]
) -> list[int]:
    """One token per row of `logits` `[batch, vocab]`; row b is the token at `positions[b]`."""
    greedy = logits.argmax(-1).tolist()  # one call for the batch: the common case stays cheap
    for b, s in enumerate(samplings):
        if s is not None and not s.greedy:
            greedy[b] = sample_row(logits[b], s.temperature, s.top_p, uniform(s.seed, positions[b]))
    return greedy
