"""The coordinator's channel cache replaces a channel its worker went away from (services/coordinator
Stubs): a worker replaced under the same name may be back at a new address."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ampd import grpcserver
from ampd.stubs import Stubs


async def _serving(port: int = 0):
    return await grpcserver.start_server(f"127.0.0.1:{port}", lambda s: None, [])


async def _check(channel) -> None:
    # wait_for_ready: a server just started on a port may take a moment to accept (a loaded box)
    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                    wait_for_ready=True)


async def test_a_failed_channel_is_replaced_with_its_streams():
    server, port, _ = await _serving()
    addr = f"127.0.0.1:{port}"
    stubs = Stubs()
    decode, control = stubs.decode(addr), stubs.control(addr)
    first = stubs._channels[addr]
    await _check(first)
    assert stubs.decode(addr) is decode and stubs.control(addr) is control, "reused while healthy"
    await server.stop(None)
    for _ in range(100):  # the channel notices the peer is gone
        if first.get_state(try_to_connect=True) == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            break
        await asyncio.sleep(0.05)
    assert first.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE
    server, _, _ = await _serving(port)  # back under the same address
    try:
        assert stubs.decode(addr) is not decode and stubs.control(addr) is not control
        assert stubs._channels[addr] is not first
        await _check(stubs._channels[addr])
    finally:
        await server.stop(None)
        await stubs._channels[addr].close()


async def test_a_new_worker_process_gets_a_new_channel():
    server, port, _ = await _serving()
    addr = f"127.0.0.1:{port}"
    stubs = Stubs()
    try:
        decode = stubs.decode(addr, "decode-0-10-111")
        submit = stubs.submit(addr, "decode-0-10-111")
        assert stubs.decode(addr, "decode-0-10-111") is decode and stubs.decode(addr) is decode
        assert stubs.submit(addr) is submit
        fresh = stubs.decode(addr, "decode-0-12-222")  # the same address, another process
        assert fresh is not decode and stubs.submit(addr, "decode-0-12-222") is not submit
        await _check(stubs._channels[addr])
    finally:
        await server.stop(None)
        await stubs._channels[addr].close()
