"""The whole path, live: Redis, NIXL, coordinator, prefill and decode workers and sidecars as
subprocesses on loopback, mock engines. Every token and every KV byte that crossed NIXL is checked."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from ampd import grpcserver
from ampd.bench.client import replay
from ampd.coordinators import session_events
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc
from ampd.workload import generate
from tests.integration.rpc_metrics import worker_metrics

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def deployment(redis_url, tmp_path_factory):
    opts = Options(prefill="tp8*2", decode="tp8*2", profile="qwen3-32b@h20", policy="remote",
                   redis_url=redis_url, namespace="live", ttft_slo=2.0, itl_slo=0.1,
                   run_dir=str(tmp_path_factory.mktemp("run")))
    with Deployment(opts) as dep:
        yield dep


def test_fifty_toolbench_sessions_all_tokens_and_kv_bytes_right(deployment, redis_url):
    sessions = generate("toolbench", rate=5.0, duration=30.0, seed=7)[:50]
    assert len(sessions) == 50
    records, stats, wall, labels = asyncio.run(
        replay(deployment.coordinator, sessions, verify_tokens=True, progress=False, timeout_s=180))
    assert labels["policy"] == "remote"
    failed = [r for r in records if not r.completed]
    assert not failed, f"{len(failed)} sessions failed: {[r.error for r in failed[:3]]}"
    expected_tokens = sum(r.output for s in sessions for r in s.rounds)
    assert stats.tokens == expected_tokens
    assert stats.token_mismatches == 0
    expected_rounds = sum(len(s.rounds) for s in sessions)
    assert sum(len(r.rounds) for r in records) == expected_rounds
    assert all(rr.local is False for r in records for rr in r.rounds)  # policy remote

    # No Redis session state and no KV blocks remain; every KV byte that crossed NIXL was right.
    assert redis.Redis.from_url(redis_url).keys("live:session:*") == []
    metrics = asyncio.run(worker_metrics(redis_url, "live"))
    assert {k for k, _ in metrics.values()} == {"prefill", "decode"}
    verified = {"prefill": 0.0, "decode": 0.0}
    for wid, (kind, m) in metrics.items():
        assert m["kv_bytes_mismatched"] == 0, wid
        assert m["kv_free_tokens"] == m["kv_capacity_tokens"], f"{wid} still holds KV"
        verified[kind] += m["kv_bytes_verified"]
        if kind == "decode":
            assert m["active_sessions"] == 0
    # Decode workers verified every new-KV byte written back; prefill workers every history byte read.
    bpt = 64
    # (a round after the first also prefills the previous round's last output token)
    assert verified["decode"] == bpt * sum(r.input + (i > 0) for s in sessions for i, r in enumerate(s.rounds))
    assert verified["prefill"] > 0


def _turn(n: int, out: int, **kw) -> common_pb2.Turn:
    return common_pb2.Turn(token_ids=list(range(1, n + 1)), sampling=common_pb2.SamplingParams(max_tokens=out), **kw)


def test_bad_session_fields_get_invalid_argument_and_others_keep_working(deployment):
    async def scenario():
        ch = grpcserver.channel(deployment.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)

        async def run(*msgs: coordinator_pb2.ClientMessage):
            call = stub.Session(iter(msgs), timeout=30)
            return [ev async for ev in session_events(call)]

        def opening(sid: str, turn: common_pb2.Turn) -> coordinator_pb2.ClientMessage:
            return coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=sid, turn=turn))

        bad_sampling = common_pb2.SamplingParams(max_tokens=0)
        nan_tool = common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(latency_s=float("nan")), result_tokens=3,
                                           sampling=common_pb2.SamplingParams(max_tokens=2))
        cases = {
            "open.session_id": [opening("", _turn(5, 2))],
            "open.turn": [coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id="bad-0"))],
            "open.turn.token_ids": [opening("bad-1", _turn(0, 2))],
            "open.turn.sampling.max_tokens": [opening("bad-2", common_pb2.Turn(token_ids=[1], sampling=bad_sampling))],
            "open.turn.script[0].tool.latency_s": [opening("bad-3", _turn(5, 2, script=[nan_tool]))],
            "open.turn.token_ids[1]": [opening("bad-4", common_pb2.Turn(
                token_ids=[1, 49_152], sampling=common_pb2.SamplingParams(max_tokens=2)))],
            "open.turn.sampling.stop": [opening("bad-5", common_pb2.Turn(
                token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=2, stop=["\n"])))],
            # a later turn: the session ends with the turn's error
            "turn.sampling.max_tokens": [opening("bad-6", _turn(5, 2)), coordinator_pb2.ClientMessage(
                turn=common_pb2.Turn(token_ids=[1], sampling=bad_sampling))],
            "turn.keep_tokens": [opening("bad-7", _turn(5, 2)), coordinator_pb2.ClientMessage(
                turn=_turn(3, 2, keep_tokens=100))],
        }
        for field, msgs in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await run(*msgs)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert info.value.details().startswith(field + ":"), (field, info.value.details())
        good = await run(opening("good-after-bad", _turn(40, 3)))
        assert good[-1].HasField("done")
        await ch.close()

    asyncio.run(scenario())


def test_turns_one_at_a_time_on_one_session(deployment):
    """A session answers turns as they come: the history grows by each turn's input and output, the
    next prefill starts where the KV ends, and a rewound turn (keep_tokens) drops the tail."""
    async def scenario():
        ch = grpcserver.channel(deployment.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        outbox: asyncio.Queue = asyncio.Queue()
        await outbox.put(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(
            session_id="turns", turn=_turn(30, 4))))

        async def requests():
            while (m := await outbox.get()) is not None:
                yield m

        follow = [_turn(7, 3), _turn(5, 2, keep_tokens=20)]
        ends, rounds, positions = [], [], []
        call = stub.Session(requests(), timeout=60)
        # the session is bound: its headers come before any event (proto/ampd/v1/coordinator.proto)
        metadata = tuple(await call.initial_metadata())
        async for ev in session_events(call):
            kind = ev.WhichOneof("event")
            if kind == "tokens":
                positions.extend(range(ev.tokens.position, ev.tokens.position + len(ev.tokens.token_ids)))
            elif kind == "turn_end":
                ends.append((ev.turn_end.round, ev.turn_end.finish_reason, ev.turn_end.history_tokens))
                await outbox.put(coordinator_pb2.ClientMessage(turn=follow.pop(0)) if follow else None)
            elif kind == "done":
                rounds = [(t.round, t.l_hist, t.l_incr, t.tokens, t.finish_reason) for t in ev.done.rounds]
        await ch.close()
        return metadata, ends, rounds, positions

    metadata, ends, rounds, positions = asyncio.run(scenario())
    assert grpcserver.SESSION_OPEN in metadata
    assert ends == [(0, "length", 34), (1, "length", 44), (2, "length", 27)]
    # round 1 prefills round 0's last output token and its 7 new tokens on top of 33 KV tokens;
    # round 2 keeps 20 tokens (all in KV) and prefills its 5 new ones
    assert rounds == [(0, 0, 30, 4, "length"), (1, 33, 8, 3, "length"), (2, 20, 5, 2, "length")]
    assert positions == [*range(30, 34), *range(41, 44), *range(25, 27)]


def test_every_service_serves_health_and_reflection(deployment, redis_url):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from ampd.state import StateStore, connect

    async def addresses():
        store = StateStore(await connect(redis_url), "live")
        infos = await store.workers()
        await store.r.aclose()
        return {i.worker_id: i.address for i in infos.values()} | {
            f"sidecar-of-{i.worker_id}": i.sidecar for i in infos.values() if i.sidecar}

    targets = {"coordinator": deployment.coordinator, **asyncio.run(addresses())}
    assert len(targets) == 1 + 2 + 2 + 2
    for name, address in targets.items():
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
            assert "grpc.health.v1.Health" in services, name
            assert any(s.startswith("ampd.v1.") for s in services), (name, services)


def test_call_streams_answer_like_the_unary_calls(deployment, redis_url):
    """DecodeWorker.Control and PrefillWorker.SubmitStream: every request gets its own status."""
    from ampd.state import StateStore, connect
    from ampd.v1 import decode_pb2, prefill_pb2

    async def scenario():
        store = StateStore(await connect(redis_url), "live")
        infos = await store.workers()
        await store.r.aclose()
        dec = next(i.address for i in infos.values() if i.kind == "decode")
        pre = next(i.address for i in infos.values() if i.kind == "prefill")
        chans = [grpcserver.channel(dec), grpcserver.channel(pre)]
        control = grpcserver.CallStream(decode_pb2_grpc.DecodeWorkerStub(chans[0]).Control)
        submit = grpcserver.CallStream(prefill_pb2_grpc.PrefillWorkerStub(chans[1]).SubmitStream)

        async def status(stream, request) -> grpc.StatusCode:
            try:
                await stream.call(request)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        ctl = decode_pb2.ControlRequest
        # a session the worker does not hold: NOT_FOUND (the coordinator moves it, docs/deploy.md)
        assert await status(control, ctl(turn=decode_pb2.TurnRequest(
            session_id="nobody", turn=_turn(3, 2)))) == grpc.StatusCode.NOT_FOUND
        assert await status(control, ctl(turn=decode_pb2.TurnRequest(
            session_id="nobody"))) == grpc.StatusCode.INVALID_ARGUMENT
        assert await status(control, ctl(close=decode_pb2.CloseRequest(
            session_id="nobody"))) == grpc.StatusCode.NOT_FOUND
        assert await status(control, ctl(local_prefill=decode_pb2.RouteInfo(
            session_id="nobody", round=0))) == grpc.StatusCode.NOT_FOUND
        assert await status(control, ctl()) == grpc.StatusCode.INVALID_ARGUMENT
        assert await status(control, ctl(cancel=decode_pb2.CancelRequest(session_id="nobody"))) == grpc.StatusCode.OK
        assert await status(submit, prefill_pb2.SubmitRequest(task=common_pb2.PrefillTask(
            decode_worker="decode-0", l_incr=4))) == grpc.StatusCode.INVALID_ARGUMENT
        # Several calls in flight on one stream each get their own answer.
        codes = await asyncio.gather(*(status(control, ctl(cancel=decode_pb2.CancelRequest(session_id=f"n{i}")))
                                       for i in range(5)))
        assert codes == [grpc.StatusCode.OK] * 5
        control.close()
        submit.close()
        for ch in chans:
            await ch.close()

    asyncio.run(scenario())
