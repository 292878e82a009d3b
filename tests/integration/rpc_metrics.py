"""The Metrics RPC of AMPD's services, as the integration tests read it (not a test module)."""
from __future__ import annotations

from ampd import grpcserver
from ampd.state import StateStore, connect
from ampd.v1 import common_pb2, coordinator_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc

_STUBS = {"decode": decode_pb2_grpc.DecodeWorkerStub, "prefill": prefill_pb2_grpc.PrefillWorkerStub,
          "coordinator": coordinator_pb2_grpc.CoordinatorStub}


async def service_metrics(address: str, kind: str) -> dict[str, float]:
    """The Metrics values of the ``kind`` service (decode, prefill, coordinator) at ``address``."""
    ch = grpcserver.channel(address)
    try:
        return dict((await _STUBS[kind](ch).Metrics(common_pb2.MetricsRequest(), timeout=10)).values)
    finally:
        await ch.close()


async def worker_metrics(redis_url: str, namespace: str) -> dict[str, tuple[str, dict[str, float]]]:
    """worker id -> (its kind, its Metrics values), for every worker registered in ``namespace``."""
    store = StateStore(await connect(redis_url), namespace)
    try:
        return {wid: (info.kind, await service_metrics(info.address, info.kind))
                for wid, info in (await store.workers()).items()}
    finally:
        await store.r.aclose()
