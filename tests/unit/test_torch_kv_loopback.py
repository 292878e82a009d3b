"""A multi-round session on the torch engine whose history KV crosses a KV transport both ways; here
the loopback transport (real byte copies between the two pools), in
tests/integration/test_torch_kv.py NIXL.

Engine A is the decode worker: it owns the session's KV in its pool (16-token blocks, scattered).
Engine B is a prefill worker with its own pool (8-token blocks). A remote round READs the history
blocks from A into B, prefills there on top of them, and WRITEs the new KV back into the blocks A
reserved; A then decodes on top. Local rounds prefill on A. The greedy tokens must equal, token for
token, those of transformers `generate` over the whole conversation in this process.
"""

from __future__ import annotations

import random
from typing import Callable

import numpy as np
import pytest
import torch

from ampd.engine.base import DecodeSeq
from ampd.engine.torch_engine import TorchEngine
from ampd.engine.torch_models import load_model, save_tiny_llama
from ampd.kv import KVPool, KVTransport, SessionKV, segments_tokens
from ampd.kv.loopback import LoopbackHub, LoopbackTransport
from tests.kv_helpers import scatter

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB, layers=3)


def _decode(engine: TorchEngine, pool: KVPool, kv: SessionKV, last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        pos = kv.tokens
        seg = kv.reserve(pool, 1)
        (last,) = engine.decode_sync(pool, [DecodeSeq("s", pos, last, seg, pos + 1, kv.segments(0, pos))])
        kv.commit(1)
        out.append(last)
    return out


async def rounds_through(tiny_llama, transport: Callable[[str, KVPool], KVTransport]) -> None:
    """Remote and local rounds of one session, the remote ones' KV moved by two ``transport``s; the
    greedy tokens must equal transformers `generate`'s over the whole conversation."""
    # two engines as two workers would have them: each its own model object and its own pool
    eng_a = TorchEngine(load_model(tiny_llama))
    eng_b = TorchEngine(load_model(tiny_llama))
    pool_a = scatter(eng_a.make_pool(512, 16), random.Random(1))
    pool_b = scatter(eng_b.make_pool(512, 8), random.Random(2))
    tr_a, tr_b = transport("torch-dec-a", pool_a), transport("torch-pre-b", pool_b)
    tr_a.add_peer("torch-pre-b", tr_b.metadata(), tr_b.layout)
    tr_b.add_peer("torch-dec-a", tr_a.metadata(), tr_a.layout)
    rng = np.random.default_rng(3)
    # (where the prefill runs, new input tokens, output tokens): the initial prompt, then tool results
    rounds = [("local", 37, 9), ("remote", 23, 8), ("local", 11, 7), ("remote", 30, 10), ("remote", 5, 6)]
    kv_a = SessionKV()
    conversation: list[int] = []  # every token whose KV the session holds or will hold
    last = None
    try:
        for where, n_in, n_out in rounds:
            new_input = rng.integers(3, VOCAB, n_in).tolist()
            # the previous round's last output token has no KV yet: it leads the next prefill's input
            ids = ([last] if last is not None else []) + new_input
            l_hist = kv_a.tokens
            hist_a = kv_a.segments(0, l_hist)
            dest_a = kv_a.reserve(pool_a, len(ids))
            if where == "local":
                first = eng_a.prefill_sync(pool_a, ids, hist_a, dest_a)
            else:
                kv_b = SessionKV()
                hist_b = kv_b.reserve(pool_b, l_hist)
                assert await tr_b.read("torch-dec-a", hist_a, hist_b) == l_hist * eng_b.kv_bytes_per_token
                kv_b.commit(l_hist)
                new_b = kv_b.reserve(pool_b, len(ids))
                first = eng_b.prefill_sync(pool_b, ids, hist_b, new_b)
                await tr_b.write("torch-dec-a", new_b, dest_a)
                kv_b.release(pool_b)
                pool_b.buffer.fill(0)  # nothing of this round may survive on B
            kv_a.commit(len(ids))
            out = [first] + _decode(eng_a, pool_a, kv_a, first, n_out - 1)
            expect = eng_a.model.generate(
                torch.tensor([conversation + ids]), max_new_tokens=n_out, min_new_tokens=n_out,
                do_sample=False,
            )[0, len(conversation) + len(ids):].tolist()
            assert out == expect, f"{where} round after {len(conversation)} tokens"
            conversation += ids + out[:-1]
            last = out[-1]
            assert kv_a.tokens == len(conversation)
        assert segments_tokens(kv_a.segments(0, kv_a.tokens)) == (37 + 24 + 12 + 31 + 6) + (8 + 7 + 6 + 9 + 5)
        assert tr_b.bytes_read > 0 and tr_b.bytes_written > 0
    finally:
        tr_a.close()
        tr_b.close()


@pytest.mark.timeout(120)
async def test_remote_and_local_rounds_through_the_loopback_equal_one_model(tiny_llama):
    hub = LoopbackHub()
    await rounds_through(tiny_llama, lambda name, pool: LoopbackTransport(name, pool, hub=hub))
