"""The mock engine: timed by a performance profile, deterministic tokens, real KV bytes.

It sleeps the modelled time (burning no CPU), so a CPU box runs the whole distributed path at
GPU-like timing. Token at a position and KV content of a position are pure functions of
(session, position), so every token a client receives and every KV byte that crossed NIXL can be
checked by anyone. It ignores sampling parameters and has no end-of-turn token: a round ends only
at max_tokens or at a stop the client asked for.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from functools import lru_cache
from typing import Sequence

from ampd.engine.capabilities import MOCK
from ampd.engine.base import DecodeSeq, Sampling
from ampd.kv import KVPool, Segment, kv_pattern
from ampd.perf import Profile

VOCAB_SIZE = 32_000  # the ids it produces (token_at)
# The ids it accepts as input: those of the default text tokenizer (SmolLM2's, ampd.chat.tokenizer),
# so that text sent through a front reaches the mock as it would reach the real model.
INPUT_VOCAB_SIZE = 49_152


@lru_cache(maxsize=65_536)
def _session_seed(session_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little")


def token_at(session_id: str, position: int) -> int:
    """The token the mock engine produces at `position` of a session."""
    x = (_session_seed(session_id) ^ (position * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) % VOCAB_SIZE


async def sleep_until(deadline: float) -> None:
    # Always yield: with a zero-cost profile the worker loops must still let I/O run.
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))


class MockEngine:
    name = "mock"
    capabilities = MOCK  # a prefill is a sleep after the KV write: cancelling it stops it at once
    eos_token_ids: tuple[int, ...] = ()
    vocab_size = INPUT_VOCAB_SIZE

    def __init__(self, profile: Profile, tp: int) -> None:
        if tp not in profile.tps:
            raise ValueError(f"tp {tp} not in profile {profile.name} (has {list(profile.tps)})")
        self.profile = profile
        self.tp = tp
        self.max_context = profile.kv_capacity_tokens(tp)  # one session may fill a replica's KV

    async def prefill(
        self, session_id: str, l_hist: int, l_incr: int, pool: KVPool, new_kv: Sequence[Segment],
        *, token_ids: Sequence[int] | None = None, history_kv: Sequence[Segment] = (),
        sampling: Sampling | None = None, prefix_tokens: int = 0,
    ) -> int:
        deadline = time.monotonic() + self.profile.t_pre(self.tp, l_hist, l_incr)
        pool.write(new_kv, kv_pattern(session_id, l_hist, l_incr, pool.layout.bytes_per_token, prefix_tokens))
        await sleep_until(deadline)
        return token_at(session_id, l_hist + l_incr)

    async def decode_step(self, pool: KVPool, seqs: Sequence[DecodeSeq]) -> list[int]:
        context = sum(s.context_tokens for s in seqs)
        deadline = time.monotonic() + self.profile.t_dec(self.tp, len(seqs), context)
        bpt = pool.layout.bytes_per_token
        out = []
        for s in seqs:
            pool.write(s.kv_segments, kv_pattern(s.session_id, s.position, 1, bpt))
            out.append(token_at(s.session_id, s.position + 1))
        await sleep_until(deadline)
        return out

    async def pace_transfer(self, started: float, tokens: int, src_tp: int, dst_tp: int) -> None:
        # No yield when the transfer already took its modelled time (the zero-cost profile): the
        # transfer yielded while it ran, and a yield here let the worker's other work (a stats
        # publication, an RPC answer) into the prefill's path.
        if tokens > 0:
            deadline = started + self.profile.t_kv(tokens, src_tp, dst_tp)
            if deadline > time.monotonic():
                await sleep_until(deadline)
