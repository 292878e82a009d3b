"""The whole path, live: Redis, NIXL, coordinator, prefill and decode workers and sidecars as
subprocesses on loopback, mock engines. Every token and every KV byte that crossed NIXL is checked."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from ampd import grpcserver
from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc
from ampd.workload import generate

pytestmark = pytest.mark.timeout(240)


async def _metrics(address: str, kind: str) -> dict[str, float]:
    ch = grpcserver.channel(address)
    stub = (decode_pb2_grpc.DecodeWorkerStub if kind == "decode" else prefill_pb2_grpc.PrefillWorkerStub)(ch)
    reply = await stub.Metrics(common_pb2.MetricsRequest(), timeout=10)
    await ch.close()
    return dict(reply.values)


async def _worker_metrics(store_url: str, namespace: str) -> dict[str, tuple[str, dict[str, float]]]:
    from ampd.state import StateStore, connect

    store = StateStore(await connect(store_url), namespace)
    out = {}
    for wid, info in (await store.workers()).items():
        out[wid] = (info.kind, await _metrics(info.address, info.kind))
    await store.r.aclose()
    return out


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
    metrics = asyncio.run(_worker_metrics(redis_url, "live"))
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
    assert verified["decode"] == bpt * sum(r.input for s in sessions for r in s.rounds)
    assert verified["prefill"] > 0


def test_bad_session_fields_get_invalid_argument_and_others_keep_working(deployment):
    async def scenario():
        ch = grpcserver.channel(deployment.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)

        async def open_with(o: common_pb2.OpenSession):
            call = stub.Session(iter([coordinator_pb2.ClientMessage(open=o)]), timeout=30)
            return [ev async for ev in call]

        cases = {
            "open.session_id": common_pb2.OpenSession(rounds=[common_pb2.RoundPlan(input_tokens=5, output_tokens=2)]),
            "open.rounds[0].input_tokens": common_pb2.OpenSession(
                session_id="bad-1", rounds=[common_pb2.RoundPlan(output_tokens=2)]),
            "open.rounds[1].output_tokens": common_pb2.OpenSession(session_id="bad-2", rounds=[
                common_pb2.RoundPlan(input_tokens=5, output_tokens=2),
                common_pb2.RoundPlan(input_tokens=5, output_tokens=-3)]),
            "open.rounds[0].tool.latency_s": common_pb2.OpenSession(session_id="bad-3", rounds=[
                common_pb2.RoundPlan(input_tokens=5, output_tokens=2,
                                     tool=common_pb2.ToolSpec(name="replay", latency_s=-1)),
                common_pb2.RoundPlan(input_tokens=5, output_tokens=2)]),
        }
        for field, o in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await open_with(o)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details()
        good = await open_with(common_pb2.OpenSession(session_id="good-after-bad", rounds=[
            common_pb2.RoundPlan(input_tokens=40, output_tokens=3)]))
        assert good[-1].HasField("done")
        await ch.close()

    asyncio.run(scenario())


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
        assert await status(control, ctl(tool_result=decode_pb2.ToolResultRequest(
            session_id="nobody", call_id="x", input_tokens=3))) == grpc.StatusCode.FAILED_PRECONDITION
        assert await status(control, ctl(tool_result=decode_pb2.ToolResultRequest(
            session_id="nobody", call_id="x"))) == grpc.StatusCode.INVALID_ARGUMENT
        assert await status(control, ctl(local_prefill=decode_pb2.RouteInfo(
            session_id="nobody", round=0))) == grpc.StatusCode.FAILED_PRECONDITION
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
