"""KV eviction on a live decode worker (--kv-evict, the host KV tier off: with it evicted KV goes to
host first; docs/architecture.md "KV eviction"), through real
Redis, NIXL and gRPC: a decode worker whose KV pool (768 tokens) cannot hold two sessions' histories
at once, and two sessions whose client-side tool calls and turns leave one idle while the other needs
the room.

    a: turn 0 (300 tokens, 20 out, ends with a client-side call) ............ turn 1 (40, 10) .. idle
    b:              turn 0 (100, 10) .. turn 1 (500, 10): evicts a .. idle ...... turn 2 (30, 5): evicts a
                                                          a's turn 1 evicts b ..^

Each evicted session's next round prefills its whole history again (l_hist 0, routed like any
prefill: remote in the mock test, so it crosses NIXL), and the session goes on with every token
right. The mock engine's tokens are a function of (session, position), so every token is checked;
on the torch engine (tiny random Llama, greedy) the sessions give exactly the tokens of an
undisturbed run.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from ampd import grpcserver, perf
from ampd.coordinators import session_events
from ampd.engine.mock import token_at
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from ampd.workload.ids import filler_ids
from tests.integration.rpc_metrics import worker_metrics

pytestmark = pytest.mark.timeout(240)

KV_TOKENS = 768  # 24 blocks of 32: a's and b's histories do not fit together
VOCAB = 512  # the tiny Llama's (and within the mock's input ids)


def _profile(tmp_path: Path) -> str:
    """zero@none with 5 ms decode steps and a KV pool of KV_TOKENS at TP 1."""
    d = json.loads((Path(perf.__file__).parent / "profiles" / "zero@none.json").read_text())
    d["name"] = "kvevict@test"
    t1 = d["tp"]["1"]
    t1["kv_capacity_tokens"] = KV_TOKENS
    t1["t_dec"]["batch"]["alpha"] = [0.005] * len(t1["t_dec"]["batch"]["alpha"])
    path = tmp_path / "kvevict@test.json"
    path.write_text(json.dumps(d))
    return str(path)


def _turn(seed: int, n: int, out: int, client_call: bool = False, answers: str = "") -> common_pb2.Turn:
    script = [common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(name="lookup", client_side=True))] if client_call else []
    return common_pb2.Turn(token_ids=filler_ids(n, seed * 1000, VOCAB), script=script, tool_call_id=answers,
                           sampling=common_pb2.SamplingParams(max_tokens=out, ignore_eos=True))


class _Conversation:
    """One session on the coordinator's Session stream, a turn at a time."""

    def __init__(self, stub, sid: str) -> None:
        self.stub, self.sid = stub, sid
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.turn_ends: asyncio.Queue = asyncio.Queue()
        self.tokens: dict[int, int] = {}  # position -> token
        self.duplicates = 0
        self.call_id = ""
        self.rounds: list[common_pb2.RoundTiming] = []
        self.error = ""

    async def open(self, turn: common_pb2.Turn) -> None:
        await self.outbox.put(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=self.sid,
                                                                                         turn=turn)))
        self.reader = asyncio.create_task(self._read())
        await self._turn_end()

    async def turn(self, turn: common_pb2.Turn) -> None:
        await self.outbox.put(coordinator_pb2.ClientMessage(turn=turn))
        await self._turn_end()

    async def close(self) -> None:
        await self.outbox.put(None)  # half-close: the session ends (SessionDone)
        await self.reader

    async def _turn_end(self) -> None:
        if await asyncio.wait_for(self.turn_ends.get(), 60) is None:
            raise AssertionError(f"{self.sid}: {self.error}")

    async def _read(self) -> None:
        async def requests():
            while (m := await self.outbox.get()) is not None:
                yield m

        try:
            async for ev in session_events(self.stub.Session(requests(), timeout=90)):
                kind = ev.WhichOneof("event")
                if kind == "tokens":
                    for i, tok in enumerate(ev.tokens.token_ids):
                        self.duplicates += (ev.tokens.position + i) in self.tokens
                        self.tokens[ev.tokens.position + i] = tok
                elif kind == "tool_call":
                    self.call_id = ev.tool_call.call_id
                elif kind == "turn_end":
                    self.turn_ends.put_nowait(ev.turn_end)
                elif kind == "done":
                    self.rounds = list(ev.done.rounds)
        except grpc.aio.AioRpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
            self.turn_ends.put_nowait(None)


async def _pressure(address: str, a_id: str, b_id: str) -> tuple[_Conversation, _Conversation]:
    """The scenario of the module docstring, in that order."""
    ch = grpcserver.channel(address)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    a, b = _Conversation(stub, a_id), _Conversation(stub, b_id)
    await a.open(_turn(1, 300, 20, client_call=True))  # a waits for its client-side call's result
    await b.open(_turn(2, 100, 10))
    await b.turn(_turn(3, 500, 10))  # does not fit beside a's 320 tokens: a's KV goes
    await a.turn(_turn(4, 40, 10, answers=a.call_id))  # a prefills 360 tokens: b (idle) goes
    await b.turn(_turn(5, 30, 5))  # b prefills 650 tokens: a (idle) goes
    await asyncio.gather(a.close(), b.close())
    await ch.close()
    return a, b


async def _alone(address: str, a_id: str, b_id: str) -> tuple[_Conversation, _Conversation]:
    """The same conversations, one after the other: nothing is evicted."""
    ch = grpcserver.channel(address)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    a, b = _Conversation(stub, a_id), _Conversation(stub, b_id)
    await a.open(_turn(1, 300, 20, client_call=True))
    await a.turn(_turn(4, 40, 10, answers=a.call_id))
    await a.close()
    await b.open(_turn(2, 100, 10))
    await b.turn(_turn(3, 500, 10))
    await b.turn(_turn(5, 30, 5))
    await b.close()
    await ch.close()
    return a, b


# positions of each session's output tokens: after every earlier input and output, and this input
A_OUT = [*range(300, 320), *range(360, 370)]
B_OUT = [*range(100, 110), *range(610, 620), *range(650, 655)]


def _reshared(sharing: bool) -> int:
    """Tokens of b's history that its turn 2 finds still on the worker after its eviction: with
    --prefix-sharing (the default) the 3 full blocks of its first prompt (100 tokens), which its
    eviction left cached in the prefix index and which a's turn 1 did not need to take back (the pool
    had room for a beside them); without, none."""
    return 96 if sharing else 0


def _check_evictions(a: _Conversation, b: _Conversation, m: dict[str, float], completed: int = 2,
                     reshared: int = 0) -> None:
    for c, positions in ((a, A_OUT), (b, B_OUT)):
        assert not c.error and c.duplicates == 0, (c.sid, c.error)
        assert sorted(c.tokens) == positions, c.sid  # none missing, none extra
    (a0, a1), (b0, b1, b2) = a.rounds, b.rounds
    # a's turn 1 prefilled its whole history again (319 tokens in KV, then its last output token and
    # the new 40: its cached prompt blocks were taken back for b's turn 1); b's turn 2 likewise
    # (619 + 1 + 30), less what it shared back (``reshared``); b's turn 1 still had its own KV
    assert (a1.l_hist, a1.l_incr, a1.kv_recomputed_tokens) == (0, 360, 319)
    assert (b1.l_hist, b1.l_incr, b1.kv_recomputed_tokens) == (109, 501, 0)
    assert (b2.l_hist, b2.l_incr, b2.kv_recomputed_tokens) == (reshared, 650 - reshared, 619 - reshared)
    assert not any(t.recovered for t in (a0, a1, b0, b1, b2))
    assert m["kv_evictions"] == 3  # a, b, then a again (closed before it needed its KV)
    assert m["kv_recomputed_tokens"] == 319 + 619 - reshared
    assert m["kv_overcommits"] == 0 and m["sessions_failed"] == 0 and m["sessions_completed"] == completed
    assert m["kv_free_tokens"] == m["kv_capacity_tokens"] == KV_TOKENS and m["active_sessions"] == 0


def test_a_waiting_round_gets_kv_by_evicting_an_idle_session_which_then_completes(redis_url, tmp_path):
    opts = Options(prefill="tp1*1", decode="tp1*1", profile=_profile(tmp_path), policy="remote", kv_evict=True, kv_host_ratio=0,
                   redis_url=redis_url, namespace="kvevict", run_dir=str(tmp_path))
    with Deployment(opts) as dep:
        a, b = asyncio.run(_pressure(dep.coordinator, "a", "b"))
        metrics = asyncio.run(worker_metrics(redis_url, "kvevict"))
    d, p = metrics["decode-0"][1], metrics["prefill-0"][1]
    _check_evictions(a, b, d, reshared=_reshared(opts.policy.prefix_sharing))
    for c in (a, b):
        assert all(tok == token_at(c.sid, pos) for pos, tok in c.tokens.items()), c.sid
    # every prefill ran remotely: the recomputed histories crossed NIXL and their bytes were checked
    assert d["prefills_remote"] == 5 and d["kv_bytes_verified"] > 0 and d["kv_bytes_mismatched"] == 0
    assert p["kv_bytes_mismatched"] == 0 and p["kv_free_tokens"] == p["kv_capacity_tokens"]


def test_torch_sessions_whose_kv_was_evicted_give_the_undisturbed_greedy_tokens(redis_url, tmp_path):
    pytest.importorskip("torch")
    from ampd.engine.torch_models import save_tiny_llama

    tiny = save_tiny_llama(tmp_path / "tiny", vocab_size=VOCAB, layers=3)
    # one decode worker, every prefill on it (a prefill worker would double the start, ~10 s here);
    # the mock test above sends the recomputed histories over NIXL
    opts = Options(prefill="none", decode="tp1*1", engine="torch", model=str(tiny), profile=_profile(tmp_path),
                   policy="local", kv_evict=True, kv_host_ratio=0, ttft_slo=5.0, itl_slo=1.0,
                   redis_url=redis_url, namespace="kvevict-torch", run_dir=str(tmp_path / "run"))
    with Deployment(opts) as dep:
        ref_a, ref_b = asyncio.run(_alone(dep.coordinator, "a-alone", "b-alone"))
        assert not any(t.kv_recomputed_tokens for t in (*ref_a.rounds, *ref_b.rounds))
        a, b = asyncio.run(_pressure(dep.coordinator, "a", "b"))
        metrics = asyncio.run(worker_metrics(redis_url, "kvevict-torch"))
    _check_evictions(a, b, metrics["decode-0"][1], completed=4, reshared=_reshared(opts.policy.prefix_sharing))
    assert len(a.tokens) == 30 and len(b.tokens) == 25
    assert a.tokens == ref_a.tokens and b.tokens == ref_b.tokens
