"""Exactness through the services: multi-round sessions on the torch engine, served by a real
deployment (Redis, coordinator, a prefill and a decode worker with its sidecar, NIXL), give greedy
tokens equal, token for token, to one transformers model running the same conversation in this
process.

Each session has five rounds over three client turns: the first turn's output calls the
server-side replay tool (its result is the next round's input, on the decode worker: no client
round trip), the second turn is a client turn on top of the history, and the third turn scripts
another server-side call. Under `remote` every prefill reads the history over NIXL and writes the
new KV back; under `local` none leaves the decode worker; `threshold` mixes both in one session
(short inputs local, long ones remote); `ampd` decides by Algorithm 1.

Starting the services is most of the cost, so `remote`, `local` and `threshold`, whose workers are
the same (FCFS queues on both kinds), share one set of workers: each policy gets a coordinator of
its own over them (a coordinator holds no state a second one over the same workers would disturb).
`ampd` (TTFT-aware queues) gets its own deployment.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from ampd import grpcserver
from ampd.coordinators import session_events
from ampd.engine.torch_models import load_model, save_tiny_llama
from ampd.config import SERVICE_SETTINGS, to_argv
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from ampd.workload.ids import filler_ids

pytestmark = pytest.mark.timeout(300)

VOCAB = 512
EOS = 2  # save_tiny_llama's eos_token_id


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB, layers=3)


def _sampling(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, ignore_eos=True)


def _replay(result_tokens: int, out: int) -> common_pb2.ScriptedCall:
    return common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(name="replay", latency_s=0.01),
                                   result_tokens=result_tokens, sampling=_sampling(out))


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


# (new input ids, output tokens, scripted server-side calls: (result tokens, output tokens))
# The threshold policy (threshold 32) runs the 9- and 12-token rounds locally, the others remotely.
TURNS = [
    (_ids(1, 70), 7, [(12, 6)]),
    (_ids(2, 9), 5, []),
    (_ids(3, 40), 6, [(45, 4)]),
]


async def _session(address: str, sid: str) -> tuple[list[int], list[common_pb2.RoundTiming]]:
    """Runs the conversation; returns every output token in order and the rounds' timings."""
    ch = grpcserver.channel(address)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    outbox: asyncio.Queue = asyncio.Queue()

    def turn(i: int) -> common_pb2.Turn:
        ids, out, calls = TURNS[i]
        return common_pb2.Turn(token_ids=ids, sampling=_sampling(out), script=[_replay(*c) for c in calls])

    await outbox.put(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=sid, turn=turn(0))))

    async def requests():
        while (m := await outbox.get()) is not None:
            yield m

    tokens, rounds, nxt = [], [], 1
    async for ev in session_events(stub.Session(requests(), timeout=120)):
        kind = ev.WhichOneof("event")
        if kind == "tokens":
            tokens.extend(ev.tokens.token_ids)
        elif kind == "turn_end":
            await outbox.put(coordinator_pb2.ClientMessage(turn=turn(nxt)) if nxt < len(TURNS) else None)
            nxt += 1
        elif kind == "done":
            rounds = list(ev.done.rounds)
    await ch.close()
    return tokens, rounds


def _reference(model) -> list[int]:
    """The same conversation in one process: greedy generate over the whole history each round."""
    history: list[int] = []
    out_all: list[int] = []

    def generate(n: int) -> None:
        ids = torch.tensor([history])
        # an explicit mask: generate would otherwise take every id equal to pad_token_id for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(history):].tolist()
        history.extend(out)
        out_all.extend(out)

    for ids, out, calls in TURNS:
        history.extend(ids)
        generate(out)
        for result_tokens, n in calls:
            # the replay tool's result: ids the decode worker derives from the session position
            history.extend(filler_ids(result_tokens, len(history), VOCAB))
            generate(n)
    return out_all


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[int]:
    return _reference(load_model(tiny_llama))


def _options(policy: str, model, redis_url: str, run_dir) -> Options:
    return Options(prefill="tp1*1", decode="tp1*1", engine="torch", model=str(model), policy=policy,
                   profile="qwen3-32b@h20", threshold_tokens=32, redis_url=redis_url, namespace=f"exact-{policy}",
                   ttft_slo=5.0, itl_slo=1.0, run_dir=str(run_dir))


@pytest.fixture(scope="module")
def fcfs_workers(tiny_llama, redis_url, tmp_path_factory):
    """The workers of `remote`, `local` and `threshold`, with a coordinator under `remote`."""
    with Deployment(_options("remote", tiny_llama, redis_url, tmp_path_factory.mktemp("fcfs"))) as dep:
        yield dep


@contextmanager
def _coordinator(dep: Deployment, policy: str, run_dir):
    """One more coordinator over ``dep``'s workers (its Redis namespace), under ``policy``; its address."""
    ready = run_dir / f"coordinator-{policy}.port"
    cfg = dep.cfg.with_(policy=policy, redis_url=dep.redis_url, port=0, metrics_port=0, ready_file=str(ready))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPD_")}  # flags only, as the launcher does
    with open(run_dir / f"coordinator-{policy}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.coordinator",
                                 *to_argv(cfg, SERVICE_SETTINGS["coordinator"])],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, (run_dir / f"coordinator-{policy}.log").read_text()
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.05)
        yield f"{cfg.process.host}:{grpcserver.read_ready_file(ready)['port']}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def _served(policy: str, request, tmp_path):
    """The coordinator address of a deployment under ``policy``."""
    if policy == "remote":
        yield request.getfixturevalue("fcfs_workers").coordinator
    elif policy in ("local", "threshold"):
        with _coordinator(request.getfixturevalue("fcfs_workers"), policy, tmp_path) as address:
            yield address
    else:
        opts = _options(policy, request.getfixturevalue("tiny_llama"), request.getfixturevalue("redis_url"),
                        tmp_path)
        with Deployment(opts) as dep:
            yield dep.coordinator


@pytest.mark.parametrize("policy", ["remote", "local", "threshold", "ampd"])
def test_greedy_tokens_through_the_services_equal_one_model(policy, expected, request, tmp_path):
    with _served(policy, request, tmp_path) as address:
        async def both():
            return await asyncio.gather(_session(address, f"{policy}-a"), _session(address, f"{policy}-b"))

        (tok_a, rounds_a), (tok_b, _) = asyncio.run(both())
    assert tok_a == expected
    assert tok_b == expected  # two sessions batched together decode the same tokens
    assert [(r.round, r.tokens) for r in rounds_a] == [(0, 7), (1, 6), (2, 5), (3, 6), (4, 4)]
    where = [r.local for r in rounds_a]
    if policy == "remote":
        assert where == [False] * 5
    elif policy == "local":
        assert where == [True] * 5
    elif policy == "threshold":
        # the first prompt's 70 tokens go remote, unless its decode worker shared it (--prefix-sharing,
        # the default: the 64 tokens of its full blocks, cached there by the sessions before) and left
        # 6 new tokens, under the threshold: then it runs locally
        first = rounds_a[0]
        assert first.l_hist == first.prefix_shared_tokens in (0, 64) and first.l_hist + first.l_incr == 70
        assert where == [first.l_incr < 32, True, True, False, False]
