"""A session opened again through a coordinator after its own coordinator was lost before the client
learnt its reattach token (ampd.coordinators opens it again): live mock deployment, real Redis on a
free port, one coordinator, one prefill and two decode workers.

The lost coordinator's copy is planted as it leaves one: the session attached on one decode worker
(its stream then gone, so the worker keeps it detached for --reattach-grace) and its record and KV
promise in Redis. Opened again, the session completes on the other worker; the stale copy is
cancelled on its worker at once (not after --reattach-grace, 30 s) and its promise released with
its record, so that nothing is left booked once the session ends."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis

from ampd import grpcserver
from ampd.bench.client import replay
from ampd.launcher import Deployment, Options
from ampd.state.promises import Promises
from ampd.state.store import StateStore, connect
from ampd.trust import attach_token
from ampd.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from ampd.workload import Round, Session
from tests.integration.live_replay import fast_profile
from tests.integration.rpc_metrics import service_metrics, worker_metrics

pytestmark = pytest.mark.timeout(120)

NS = "reopened"
SID = "reopened-0"
SECRET = "the-lost-coordinators-secret"
CLEAN_S = 5.0  # well under --reattach-grace (30 s), after which the copy would go anyway


async def _plant_stale_copy(redis_url: str) -> tuple[str, int]:
    """The session attached on one decode worker, its stream then dropped, and its record and promise
    as its coordinator left them: that worker's id, and its KV capacity."""
    store = StateStore(await connect(redis_url), NS)
    try:
        info = next(i for i in (await store.workers()).values() if i.kind == "decode")
        ch = grpcserver.channel(info.address)  # (this process started the deployment: it holds its secret)
        req = decode_pb2.AttachRequest(
            open=common_pb2.OpenSession(session_id=SID, turn=common_pb2.Turn(
                token_ids=list(range(1, 65)), sampling=common_pb2.SamplingParams(max_tokens=4))),
            session_secret=SECRET, arrival=time.time(),
            attach_token=attach_token(bytes.fromhex(info.task_key), SID, info.worker_id, SECRET))
        call = decode_pb2_grpc.DecodeWorkerStub(ch).Attach(req, timeout=30)
        await call.initial_metadata()  # open there
        call.cancel()  # its coordinator is gone
        await ch.close()
        # most of the worker's KV: admission binds the session opened again to the other worker
        promises = Promises(store.r, NS, store.coordinator_key(""))
        assert (await promises.promise(SID, info.worker_id, info.kv_capacity_tokens * 3 // 4, 0, new=True)).made
        await store.update_session(SID, {"coordinator": "lost-0", "decode_worker": info.worker_id, "secret": SECRET})
        return info.worker_id, info.kv_capacity_tokens
    finally:
        await store.r.aclose()


def test_a_session_opened_again_cancels_its_lost_coordinators_copy(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    opts = Options(prefill="tp1*1", decode="tp1*2", profile=fast_profile(tmp_path, "reopened@test"),
                   policy="ampd", redis_url=redis_url, namespace=NS, run_dir=str(tmp_path / "run"))
    with Deployment(opts) as dep:
        stale_on, _ = asyncio.run(_plant_stale_copy(redis_url))
        workers = asyncio.run(worker_metrics(redis_url, NS))
        assert workers[stale_on][1]["active_sessions"] == 1  # kept there, detached

        session = Session(SID, 0.0, (Round(input=48, output=6, tool_s=0.2), Round(input=20, output=5)))
        records, stats, _, _ = asyncio.run(replay(dep.coordinator, [session], verify_tokens=True, progress=False,
                                                  timeout_s=30))
        assert records[0].completed, records[0].error
        assert stats.token_mismatches == 0 and stats.bound_to[SID] != stale_on

        t0 = time.monotonic()
        while True:
            workers = asyncio.run(worker_metrics(redis_url, NS))
            busy = {w: {k: m.get(k) for k in ("active_sessions", "kv_free_tokens", "kv_capacity_tokens")}
                    for w, (kind, m) in workers.items() if kind == "decode"
                    and (m["active_sessions"] or m["kv_free_tokens"] != m["kv_capacity_tokens"])}
            left = [k.decode() for k in r.keys(f"{NS}:session:*")] + [k.decode() for k in r.keys(f"{NS}:promise*")]
            if not busy and not left or time.monotonic() - t0 > CLEAN_S:
                break
            time.sleep(0.2)
        assert not busy, busy  # (before: the copy stayed --reattach-grace)
        assert not left, (left, r.hgetall(f"{NS}:promised"))  # (before: its promise stayed for good)
        assert workers[stale_on][1]["sessions_failed"] == 1  # the copy, cancelled
        coord = asyncio.run(service_metrics(dep.coordinator, "coordinator"))
        assert coord["sessions_replaced"] == 1 and coord["sessions_completed"] == 1
