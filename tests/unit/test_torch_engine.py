"""The torch engine on a tiny random Llama: KV in pool blocks, exact greedy tokens, bad input.

The reference everywhere is transformers' own `generate` on the whole token sequence, in this
process, with the same weights.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from ampd.engine.base import DecodeSeq
from ampd.engine.torch_engine import TorchEngine, kv_shape_of
from ampd.engine.torch_models import load_model, save_tiny_llama
from ampd.kv import KVPool, Segment, SessionKV
from ampd.kv.layout import KVShape, pool_rows, token_rows

VOCAB = 512


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB)


@pytest.fixture(scope="session")
def engine(tiny_llama):
    return TorchEngine(load_model(tiny_llama))


def _scattered_pool(engine: TorchEngine, tokens: int, block_tokens: int, seed: int) -> KVPool:
    pool = engine.make_pool(tokens, block_tokens)
    blocks = pool.alloc(pool.free_blocks)
    random.Random(seed).shuffle(blocks)
    pool.free(blocks)
    return pool


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


def _generate(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


class Seq:
    """One session on one engine and pool, driven the way a worker drives it."""

    def __init__(self, engine: TorchEngine, pool: KVPool, sid: str):
        self.engine, self.pool, self.sid = engine, pool, sid
        self.kv = SessionKV()
        self.last = -1

    def prefill(self, ids: list[int]) -> int:
        hist = self.kv.segments(0, self.kv.tokens)
        new = self.kv.reserve(self.pool, len(ids))
        self.last = self.engine.prefill_sync(self.pool, ids, hist, new)
        self.kv.commit(len(ids))
        return self.last

    def step_args(self) -> DecodeSeq:
        pos = self.kv.tokens
        new = self.kv.reserve(self.pool, 1)
        return DecodeSeq(self.sid, pos, self.last, new, pos + 1, self.kv.segments(0, pos))

    def took(self, token: int) -> None:
        self.kv.commit(1)
        self.last = token

    def decode(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            (t,) = self.engine.decode_sync(self.pool, [self.step_args()])
            self.took(t)
            out.append(t)
        return out


def test_kv_shape_and_pool_follow_the_model_config(engine):
    cfg = engine.model.config
    shape = kv_shape_of(cfg)
    assert shape == KVShape(layers=2, kv_heads=2, head_dim=16)
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    pool = engine.make_pool(100, block_tokens=16)
    assert (pool.num_blocks, pool.bytes_per_token) == (7, 512)
    rows = pool_rows(pool, shape)
    assert rows.shape == (7 * 16, 2, 2, 2, 16) and np.shares_memory(rows, pool.buffer)
    assert shape.blocks_in(pool.nbytes, 16) == 7
    with pytest.raises(ValueError, match="bytes per token"):
        pool_rows(KVPool(4, 16, 256), shape)
    with pytest.raises(ValueError, match="kv_heads must be > 0"):
        KVShape(layers=2, kv_heads=0, head_dim=16)


def test_token_rows_walks_segments_in_order():
    segs = [Segment(3, 5, 3), Segment(0, 0, 2), Segment(7, 0, 0), Segment(1, 7, 1)]
    assert token_rows(segs, 8).tolist() == [29, 30, 31, 0, 1, 15]
    assert token_rows([], 8).tolist() == []
    with pytest.raises(ValueError, match="segment 0"):
        token_rows([Segment(0, 6, 3)], 8)


def test_multi_round_session_on_one_pool_equals_generate(engine):
    """Prefill (in two chunks) + decode + a second round's prefill on top of the pool history."""
    pool = _scattered_pool(engine, 400, 16, seed=1)
    s = Seq(engine, pool, "one")
    p1 = _prompt(45, 1)
    s.prefill(p1[:20])  # a chunked prefill is a prefill on top of history
    got = [s.prefill(p1[20:])] + s.decode(11)
    assert got == _generate(engine.model, p1, 12)
    # round 2: the round's last token and the tool result are the next prefill's input
    p2 = [got[-1]] + _prompt(19, 2)
    got2 = [s.prefill(p2)] + s.decode(9)
    assert got2 == _generate(engine.model, p1 + got[:-1] + p2, 10)
    assert len(s.kv.blocks) > 1 and s.kv.blocks != sorted(s.kv.blocks)  # scattered blocks


def test_batched_decode_of_unequal_lengths_equals_each_alone(engine):
    lengths, steps = [5, 17, 40, 64], 10
    batch_pool = _scattered_pool(engine, 1024, 16, seed=2)
    alone = {}
    for i, n in enumerate(lengths):
        s = Seq(engine, engine.make_pool(n + steps + 1, 16), f"alone{i}")
        alone[i] = [s.prefill(_prompt(n, 10 + i))] + s.decode(steps)
    seqs = {i: Seq(engine, batch_pool, f"b{i}") for i in range(len(lengths))}
    got = {i: [] for i in seqs}
    for i in (0, 1, 2):
        got[i].append(seqs[i].prefill(_prompt(lengths[i], 10 + i)))
    for step in range(steps + 3):
        if step == 3:  # continuous batching: a sequence joins a running batch
            got[3].append(seqs[3].prefill(_prompt(lengths[3], 13)))
        live = [i for i in seqs if got[i] and len(got[i]) <= steps]
        if not live:
            break
        tokens = engine.decode_sync(batch_pool, [seqs[i].step_args() for i in live])
        for i, t in zip(live, tokens):
            seqs[i].took(t)
            got[i].append(t)
    assert got == alone
    assert alone[2] == _generate(engine.model, _prompt(40, 12), steps + 1)


def test_bad_input_names_the_field(engine):
    pool = engine.make_pool(64, 16)
    s = SessionKV()
    new = s.reserve(pool, 3)
    with pytest.raises(ValueError, match="token_ids: empty input"):
        engine.prefill_sync(pool, [], [], [])
    with pytest.raises(ValueError, match=r"token_ids\[1\] = 512 is outside the vocabulary"):
        engine.prefill_sync(pool, [1, VOCAB, 3], [], new)
    with pytest.raises(ValueError, match="new_kv: segments cover 3 tokens, expected 2"):
        engine.prefill_sync(pool, [1, 2], [], new)
    small = TorchEngine(engine.model)
    small.max_context = 2
    with pytest.raises(ValueError, match="context: 3 tokens exceed the model's limit of 2"):
        small.prefill_sync(pool, [1, 2, 3], [], new)
    with pytest.raises(ValueError, match="needs token_ids"):
        asyncio.run(engine.prefill("s", 0, 3, pool, new))
    with pytest.raises(ValueError, match=r"seqs\[0\].history_kv: segments cover 0 tokens, expected 2"):
        engine.decode_sync(pool, [DecodeSeq("s", 2, 5, new[:1], 3, [])])
    with pytest.raises(ValueError, match=r"last_token\[0\] = -1"):
        engine.decode_sync(pool, [DecodeSeq("s", 0, -1, s.segments(0, 1), 1, [])])
    with pytest.raises(ValueError, match="tp must be 1"):
        TorchEngine(engine.model, tp=2)


async def test_async_protocol_runs_off_the_event_loop(engine):
    pool = engine.make_pool(64, 16)
    s = SessionKV()
    ids = _prompt(9, 5)
    new = s.reserve(pool, 9)
    first = await engine.prefill("a", 0, 9, pool, new, token_ids=ids, history_kv=[])
    s.commit(9)
    seg = s.reserve(pool, 1)
    (second,) = await engine.decode_step(pool, [DecodeSeq("a", 9, first, seg, 10, s.segments(0, 9))])
    assert [first, second] == _generate(engine.model, ids, 2)
    await engine.pace_transfer(0.0, 100, 1, 1)
