"""Channels, stubs and call streams to AMPD's workers, kept per worker address."""
from __future__ import annotations

import grpc

from ampd import grpcserver
from ampd.tasks import BackgroundTasks
from ampd.v1 import decode_pb2_grpc, prefill_pb2_grpc

__all__ = ["Stubs"]


class _WithToken:
    """A stub whose every call carries the deployment's token as metadata. A channel interceptor
    does the same, but grpc.aio reads each intercepted stream's messages through a task of its own:
    ~5 % of the coordinator's CPU at load went there (benchmarks/coordinator_capacity.py)."""

    def __init__(self, stub, md: tuple[str, str]) -> None:
        self._stub = stub
        self._md = md

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        md = self._md

        def call(*args, **kwargs):
            kwargs["metadata"] = (*(kwargs.get("metadata") or ()), md)
            return method(*args, **kwargs)
        return call


class Stubs:
    """One channel per worker address, reused by every session, and one call stream per worker for
    the per-round requests (Control; Submit): see grpcserver.CallStream. The coordinator keeps one
    for every worker, a decode worker one for the prefill workers it submits routed prefills to.

    A channel is replaced, with its stubs and call streams, when the worker at its address is a new
    process (its registration's NIXL agent name, unique per process, changed) or when it is found in
    TRANSIENT_FAILURE: the worker went away and may be back under the same name at a new address (a
    replaced container). A new channel resolves the name at once, where the old one keeps dialling
    the old address until its next re-resolution (make test-compose: 3 to 16 of 16 sessions opened
    just after a decode-worker swap failed that way)."""

    def __init__(self, on_broken=None) -> None:
        self.on_broken = on_broken  # (address) -> None: a call stream to that worker failed
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._incarnation: dict[str, str] = {}  # address -> the worker process its channel is for
        self._decode: dict[str, decode_pb2_grpc.DecodeWorkerStub] = {}
        self._prefill: dict[str, prefill_pb2_grpc.PrefillWorkerStub] = {}
        self._control: dict[str, grpcserver.CallStream] = {}
        self._submit: dict[str, grpcserver.CallStream] = {}
        self._closing = BackgroundTasks()  # the channels (and their call streams) being closed

    def _channel(self, address: str, incarnation: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        new_process = bool(incarnation) and self._incarnation.get(address, incarnation) != incarnation
        if ch is not None and (new_process or ch.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            self._forget(address)
            ch = None
        if incarnation:
            self._incarnation[address] = incarnation
        if ch is None:
            # no interceptor: the token goes with each call (_WithToken)
            ch = self._channels[address] = grpcserver.channel(address, token="")
        return ch

    @staticmethod
    def _authed(stub):
        token = grpcserver._internal()
        return _WithToken(stub, ("authorization", f"Bearer {token}")) if token else stub

    def drop(self, address: str) -> None:
        """Closes the channel and call streams to the worker at ``address`` (fenced: it stopped
        answering): every call in flight on them fails now instead of at its deadline."""
        if address in self._channels:
            self._forget(address)

    def _forget(self, address: str) -> None:
        ch = self._channels.pop(address)
        self._decode.pop(address, None)
        self._prefill.pop(address, None)
        streams = [s for s in (self._control.pop(address, None), self._submit.pop(address, None)) if s is not None]
        for stream in streams:
            stream.close()
        self._closing.spawn(self._close(ch, streams))

    @staticmethod
    async def _close(ch: grpc.aio.Channel, streams: list[grpcserver.CallStream]) -> None:
        await ch.close()
        for stream in streams:
            await stream.wait_closed()

    async def close(self) -> None:
        """Closes every channel and call stream (at shutdown) and awaits them."""
        for address in list(self._channels):
            self._forget(address)
        await self._closing.close(cancel=False)

    def control(self, address: str, incarnation: str = "") -> grpcserver.CallStream:
        """DecodeWorker.Control of the worker at `address`: send decode_pb2.ControlRequest."""
        worker = self.decode(address, incarnation)
        if address not in self._control:
            self._control[address] = grpcserver.CallStream(worker.Control, self._broken(address))
        return self._control[address]

    def submit(self, address: str, incarnation: str = "") -> grpcserver.CallStream:
        """PrefillWorker.SubmitStream of the worker at `address`: send prefill_pb2.SubmitRequest."""
        worker = self.prefill(address, incarnation)
        if address not in self._submit:
            self._submit[address] = grpcserver.CallStream(worker.SubmitStream, self._broken(address))
        return self._submit[address]

    def _broken(self, address: str):
        return (lambda exc: self.on_broken(address)) if self.on_broken else None

    def decode(self, address: str, incarnation: str = "") -> decode_pb2_grpc.DecodeWorkerStub:
        ch = self._channel(address, incarnation)
        if address not in self._decode:
            self._decode[address] = self._authed(decode_pb2_grpc.DecodeWorkerStub(ch))
        return self._decode[address]

    def prefill(self, address: str, incarnation: str = "") -> prefill_pb2_grpc.PrefillWorkerStub:
        ch = self._channel(address, incarnation)
        if address not in self._prefill:
            self._prefill[address] = self._authed(prefill_pb2_grpc.PrefillWorkerStub(ch))
        return self._prefill[address]
