"""The internal gRPC surface of a live deployment whose client API is open (no auth_token): the
workers and sidecars still require the deployment's internal secret, and a decode worker opens a
session (allocates its KV) only with an attach token the coordinator minted (issue 24 item 7,
finding 11: a raw DecodeWorker.Attach allocated 1,875 blocks without admission)."""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest
import redis

from ampd import grpcserver
from ampd.coordinators import session_events
from ampd.launcher import Deployment, Options
from ampd.state.store import WorkerInfo
from ampd.trust import attach_token, new_key
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, decode_pb2, decode_pb2_grpc, sidecar_pb2_grpc

pytestmark = pytest.mark.timeout(120)

NS = "internal"


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    opts = Options(prefill="1", decode="1", profile="qwen3-32b@h20", redis_url=redis_url, namespace=NS,
                   kv_pool_mb=4, kv_bytes_per_token=512, run_dir=str(tmp_path_factory.mktemp("run")))
    with Deployment(opts) as d:
        yield d


def decode_info(redis_url) -> WorkerInfo:
    raw = redis.Redis.from_url(redis_url).hgetall(f"{NS}:workers")
    return next(i for i in map(WorkerInfo.from_json, raw.values()) if i.kind == "decode")


def opening(n: int, out: int, sid: str = "") -> common_pb2.OpenSession:
    return common_pb2.OpenSession(session_id=sid or uuid.uuid4().hex, turn=common_pb2.Turn(
        token_ids=list(range(1, n + 1)), sampling=common_pb2.SamplingParams(max_tokens=out)))


async def decode_metrics(address: str) -> dict[str, float]:
    ch = grpcserver.channel(address)
    try:
        return dict((await decode_pb2_grpc.DecodeWorkerStub(ch).Metrics(common_pb2.MetricsRequest(),
                                                                         timeout=10)).values)
    finally:
        await ch.close()


async def attach_status(address: str, req: decode_pb2.AttachRequest, token: str | None) -> tuple[grpc.StatusCode, str]:
    ch = grpcserver.channel(address, token=token)
    try:
        async for _ in decode_pb2_grpc.DecodeWorkerStub(ch).Attach(req, timeout=10):
            pass
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    finally:
        await ch.close()


def test_ampd_up_makes_a_secret_and_hands_it_over_in_the_environment_only(dep):
    secret = dep.internal_token
    assert len(secret) >= 24
    for c in dep.children:
        if c.name == "redis":
            continue
        pid = c.proc.pid
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), c.name
        # deathsig.wrap execs the service: its environment carries the secret
        assert f"AMPD_INTERNAL_TOKEN={secret}".encode() in Path(f"/proc/{pid}/environ").read_bytes(), c.name


def test_an_open_client_api_leaves_the_internal_surface_closed(dep, redis_url):
    info = decode_info(redis_url)

    async def scenario():
        # the client API is open: no token needed for a whole session
        ch = grpcserver.channel(dep.coordinator, token="")
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        msgs = [coordinator_pb2.ClientMessage(open=opening(20, 3)),
                coordinator_pb2.ClientMessage(close=coordinator_pb2.Close())]
        events = [ev async for ev in session_events(stub.Session(iter(msgs), timeout=30))]
        assert events[-1].HasField("done")
        await ch.close()
        for address, stub_cls in ((info.address, decode_pb2_grpc.DecodeWorkerStub),
                                  (info.sidecar, sidecar_pb2_grpc.ToolSidecarStub)):
            for token in ("", "wrong"):
                ch = grpcserver.channel(address, token=token)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub_cls(ch).Metrics(common_pb2.MetricsRequest(), timeout=10)
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, address
                await ch.close()

    asyncio.run(scenario())


def test_a_raw_attach_is_refused_and_allocates_nothing(dep, redis_url):
    """Finding 11, scaled down: an Attach of 1,800 tokens with no credential, with the internal
    secret but no attach token, with a forged one, and with one for another session or worker."""
    info = decode_info(redis_url)
    key = bytes.fromhex(info.task_key)

    async def scenario():
        before = await decode_metrics(info.address)
        o = opening(1800, 1000)
        forged = [
            ("", grpc.StatusCode.PERMISSION_DENIED),
            (attach_token(new_key(), o.session_id, info.worker_id, "s"), grpc.StatusCode.PERMISSION_DENIED),
            (attach_token(key, "another-session", info.worker_id, "s"), grpc.StatusCode.PERMISSION_DENIED),
            (attach_token(key, o.session_id, "decode-9", "s"), grpc.StatusCode.PERMISSION_DENIED),
            (attach_token(key, o.session_id, info.worker_id, "other-secret"), grpc.StatusCode.PERMISSION_DENIED),
        ]
        req = decode_pb2.AttachRequest(open=o, session_secret="s")
        code, details = await attach_status(info.address, req, token="")
        assert code == grpc.StatusCode.UNAUTHENTICATED, details
        for tok, want in forged:
            req.attach_token = tok
            code, details = await attach_status(info.address, req, token=None)
            assert code == want and details.startswith("attach_token:"), (code, details)
        after = await decode_metrics(info.address)
        assert after["kv_free_tokens"] == before["kv_free_tokens"] == after["kv_capacity_tokens"]
        assert after["active_sessions"] == 0 and after["sessions_opened"] == before["sessions_opened"]
        # what the coordinator mints opens it (under the key the worker published)
        req.attach_token = attach_token(key, o.session_id, info.worker_id, "s")
        ch = grpcserver.channel(info.address)
        call = decode_pb2_grpc.DecodeWorkerStub(ch).Attach(req, timeout=10)
        assert dict(await call.initial_metadata()).get("ampd-session") == "open"
        call.cancel()
        await ch.close()

    asyncio.run(scenario())
