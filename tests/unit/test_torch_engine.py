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

from ampd.engine.base import DecodeSeq, Sampling
from ampd.engine.sampling import sample_row, uniform
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
    assert engine._fused.packed is not None  # 4 sequences ran on the oneDNN-blocked weights (PACK_FROM)


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


# --- sampling ------------------------------------------------------------------------------------
def _session_tokens(engine, ids: list[int], n: int, sampling, *, split: int | None = None,
                    other: TorchEngine | None = None) -> list[int]:
    """n output tokens of one session; with `split`, the prompt's tail is a second prefill run on
    `other` (a remote prefill worker: another engine, another pool with another block size)."""
    pool = _scattered_pool(engine, len(ids) + n + 16, 16, seed=3)
    s = SessionKV()
    first = ids if split is None else ids[:split]
    last = engine.prefill_sync(pool, first, [], s.reserve(pool, len(first)), sampling)
    s.commit(len(first))
    if split is not None:
        rest = ids[split:]
        remote = other.make_pool(len(ids) + 8, 8)
        hist = SessionKV()
        remote.write(hist.reserve(remote, len(first)), pool.read(s.segments(0, len(first))))
        hist.commit(len(first))
        new_remote = hist.reserve(remote, len(rest))
        last = other.prefill_sync(remote, rest, hist.segments(0, len(first)), new_remote, sampling)
        pool.write(s.reserve(pool, len(rest)), remote.read(new_remote))  # the WRITE back
        s.commit(len(rest))
    out = [last]
    for _ in range(n - 1):
        pos = s.tokens
        seg = s.reserve(pool, 1)
        (last,) = engine.decode_sync(
            pool, [DecodeSeq("x", pos, last, seg, pos + 1, s.segments(0, pos), sampling)]
        )
        s.commit(1)
        out.append(last)
    return out


def test_greedy_sampling_equals_no_sampling_and_generate(engine):
    ids = _prompt(30, 21)
    want = _generate(engine.model, ids, 8)
    assert _session_tokens(engine, ids, 8, None) == want
    assert _session_tokens(engine, ids, 8, Sampling(temperature=0.0, top_p=0.3, seed=5)) == want


def test_seeded_sampling_is_reproducible_across_local_and_remote_prefill(engine, tiny_llama):
    ids = _prompt(30, 22)
    hot = Sampling(temperature=4.0, seed=1234)
    a = _session_tokens(engine, ids, 12, hot)
    assert _session_tokens(engine, ids, 12, hot) == a
    remote = TorchEngine(load_model(tiny_llama))
    assert _session_tokens(engine, ids, 12, hot, split=18, other=remote) == a
    assert a != _generate(engine.model, ids, 12)  # it did sample
    assert _session_tokens(engine, ids, 12, Sampling(temperature=4.0, seed=99)) != a


def test_sampling_is_per_sequence_in_a_batch(engine):
    """A seeded sequence gets the same tokens alone and next to greedy and unseeded ones."""
    hot = Sampling(temperature=4.0, seed=7)
    alone = _session_tokens(engine, _prompt(20, 31), 6, hot)
    greedy = _generate(engine.model, _prompt(12, 32), 6)
    pool = _scattered_pool(engine, 256, 16, seed=4)
    seqs = [Seq(engine, pool, f"m{i}") for i in range(3)]
    prompts = [_prompt(20, 31), _prompt(12, 32), _prompt(15, 33)]
    plan = [hot, None, Sampling(temperature=1.0)]
    got = []
    for q, p, sp in zip(seqs, prompts, plan):
        q.last = engine.prefill_sync(pool, p, [], q.kv.reserve(pool, len(p)), sp)
        q.kv.commit(len(p))
        got.append([q.last])
    for _ in range(5):
        args = []
        for q, sp in zip(seqs, plan):
            a = q.step_args()
            a.sampling = sp
            args.append(a)
        for q, g, t in zip(seqs, got, engine.decode_sync(pool, args)):
            q.took(t)
            g.append(t)
    assert got[0] == alone and got[1] == greedy


def test_sample_row_follows_temperature_and_top_p():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25]))
    grid = [(i + 0.5) / 1000 for i in range(1000)]  # evenly spread u: counts are exact shares

    def counts(t: float, p: float) -> list[int]:
        c = [0] * 4
        for u in grid:
            c[sample_row(logits, t, p, u)] += 1
        return c

    assert counts(1.0, 1.0) == [100, 500, 150, 250]
    # top_p 0.7: the nucleus is {1, 3} (0.5 + 0.25 >= 0.7), renormalised to 2/3 and 1/3
    assert counts(1.0, 0.7) == [0, 667, 0, 333]
    assert counts(1.0, 0.5) == [0, 1000, 0, 0]  # the top token alone reaches 0.5
    assert counts(0.0, 1.0) == [0, 1000, 0, 0]  # greedy
    hot = counts(100.0, 1.0)  # a high temperature flattens towards uniform
    assert all(240 <= c <= 260 for c in hot)
    cold = counts(0.05, 1.0)
    assert cold[1] == 1000


def test_uniform_is_a_function_of_seed_and_position():
    draws = [uniform(42, p) for p in range(2000)]
    assert draws == [uniform(42, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == 2000
    assert 0.45 < sum(draws) / len(draws) < 0.55
    assert uniform(43, 0) != uniform(42, 0) and uniform(-1, 5) == uniform(-1, 5)
    assert 0.0 <= uniform(None, 3) < 1.0


def test_sampling_fields_are_checked():
    for kw, field in ((dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
                      (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed=1.5), "seed")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            Sampling(**kw)
    assert Sampling().greedy and not Sampling(temperature=0.7).greedy


def test_engine_reports_eos_vocab_and_context(engine):
    assert engine.eos_token_ids == (2,)  # save_tiny_llama's config
    assert (engine.vocab_size, engine.max_context) == (VOCAB, 1024)


def test_fast_decode_equals_the_pool_cache_path(engine):
    """Llama-family models decode over resident KV (torch_fast); the generic PoolCache path, which
    other models take, gives the same tokens for a batch of unequal lengths."""
    generic = TorchEngine(engine.model)
    generic.fast = False
    assert engine.fast
    out = {}
    for eng in (engine, generic):
        pool = _scattered_pool(eng, 512, 16, seed=4)
        seqs = [Seq(eng, pool, f"f{i}") for i in range(3)]
        got = [[s.prefill(_prompt(n, 30 + n))] for s, n in zip(seqs, (7, 33, 50))]
        for _ in range(8):
            for g, s, t in zip(got, seqs, eng.decode_sync(pool, [s.step_args() for s in seqs])):
                s.took(t)
                g.append(t)
        out[eng] = got
    assert out[engine] == out[generic]


def test_a_rewritten_history_is_read_from_the_pool_after_forget(engine):
    """A rewind rewrites positions the resident KV already holds, in the same pool rows, and the next
    step sits where the resident KV ends: only `forget` (the worker calls it at every round's end)
    makes the step read the new KV from the pool."""
    pool = engine.make_pool(256, 16)
    s = Seq(engine, pool, "rw")
    prompt, edit = _prompt(20, 40), _prompt(5, 41)
    s.prefill(prompt)
    s.decode(5)  # resident KV: positions [0, 25)
    engine.forget("rw")
    s.kv.truncate(pool, 20)
    got = [s.prefill(edit)] + s.decode(6)  # the prefill rewrites positions 20..24 in the same rows
    assert got == _generate(engine.model, prompt + edit, 7)


def test_fused_projections_give_the_same_logits_bits(engine):
    """A decode step over the fused q/k/v and gate/up weights gives exactly the logits of the separate
    projections at batch 1 (what makes a lone session's tokens `generate`'s bit for bit)."""
    from ampd.engine.torch_fast import Resident, decode_forward

    assert engine._fused is not None
    pool = engine.make_pool(128, 16)
    s = Seq(engine, pool, "fz")
    s.prefill(_prompt(37, 50))
    step = s.step_args()
    rows = engine._rows(pool)
    hist = token_rows(step.history_kv, 16)
    write = token_rows(step.kv_segments, 16)
    out = []
    for fused in (engine._fused, None):
        with torch.inference_mode():
            out.append(decode_forward(engine.model, torch.tensor([[s.last]]), torch.tensor([[step.position]]),
                                      [Resident.from_pool(rows, hist, 1)], rows, write, fused))
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("l_hist", [0, 21])
def test_fast_prefill_matches_transformers_forward(engine, l_hist):
    """A Llama-family prefill runs through torch_fast (`prefill_forward`): for 1 to 17 new tokens on
    top of a history, the KV it writes into the pool is transformers' forward's but for the last bits
    (the blocked weights sum in another order), and the next token is the same."""
    generic = TorchEngine(engine.model)
    generic.fast = False
    hist = _prompt(l_hist, 60)
    for n in (1, 2, 3, 4, 17):
        new = _prompt(n, 61 + n)
        got = {}
        for eng in (engine, generic):
            pool = eng.make_pool(64, 16)
            s = Seq(eng, pool, "p")
            if hist:
                s.prefill(hist)
            token = s.prefill(new)
            kv = eng._rows(pool)[torch.from_numpy(token_rows(s.kv.segments(0, l_hist + n), 16))]
            got[eng.fast] = (token, kv.clone())
        assert got[True][0] == got[False][0], n
        assert torch.allclose(got[True][1], got[False][1], rtol=1e-4, atol=1e-5), n
        assert not torch.equal(got[True][1], torch.zeros_like(got[True][1]))
