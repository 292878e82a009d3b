"""What every AMPD gRPC server shares: health checking, reflection, signal-driven shutdown."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Token streams are small messages; keep keepalives modest so a dead peer is noticed.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.so_reuseport", 0),
]


async def start_server(
    bind: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts a grpc.aio server on `bind` (host:port, port 0 = free) with health and reflection.

    Returns the server, the bound port and the health servicer (set SERVING when ready).
    """
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise RuntimeError(f"cannot bind {bind}")
    await server.start()
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 2.0,
) -> None:
    """Runs until SIGINT/SIGTERM, then reports NOT_SERVING, runs on_stop and stops the server."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    await health_servicer.enter_graceful_shutdown()
    if on_stop is not None:
        await on_stop()
    await server.stop(grace_s)
    stopper.cancel()


def run(main: Awaitable[None]) -> None:
    """Runs a service's async main on uvloop."""
    import uvloop

    uvloop.run(main)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        address,
        options=[("grpc.keepalive_time_ms", 20_000), ("grpc.enable_http_proxy", 0)],
    )


def write_ready_file(path: str, port: int) -> None:
    """Tells whoever started this server (`ampd up`) the bound port: written atomically, once serving."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)
