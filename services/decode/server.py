"""Decode worker gRPC server: a thin adapter over services.decode.worker.DecodeCore."""
from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
import structlog

from ampd import grpcserver, logs
from ampd.grpcserver import RpcFailure, abort_on_failure, serve_calls
from ampd.engine.mock import make_engine
from ampd.perf import load_profile
from ampd.policy import SLO, make_queue, policy_spec
from ampd.state import StateStore, connect
from ampd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, sidecar_pb2_grpc
from ampd.runtime import WorkerRuntime, add_worker_args, config_from_args, pool_for, write_ready_file
from services.decode.worker import DecodeCore, SessionError, SessionFailed

log = structlog.get_logger()


class DecodeService(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self) -> None:
        self.core: DecodeCore | None = None

    async def Attach(self, request: decode_pb2.AttachRequest, context: grpc.aio.ServicerContext):
        core = self.core
        o = request.open
        if not o.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open.session_id: required")
        if not o.rounds:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open.rounds: at least one round is required")
        try:
            s = core.open(request)
        except SessionError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        try:
            while True:
                ev = await s.events.get()
                if isinstance(ev, SessionFailed):
                    await context.abort(grpc.StatusCode.ABORTED, ev.error)
                # Coalesce queued token events of the same round into one message.
                if ev.HasField("tokens"):
                    while not s.events.empty():
                        nxt = s.events._queue[0]  # peek: asyncio.Queue keeps a deque
                        if isinstance(nxt, SessionFailed) or not nxt.HasField("tokens") or nxt.tokens.round != ev.tokens.round:
                            break
                        s.events.get_nowait()
                        ev.tokens.token_ids.extend(nxt.tokens.token_ids)
                        ev.tokens.times.extend(nxt.tokens.times)
                yield ev
                if ev.HasField("done"):
                    return
        finally:
            if not s.closed:  # the coordinator went away mid-session
                core.cancel(s.session_id, "attach stream closed")

    # LocalPrefill, ToolResult and Cancel: one body each, served as unary calls and on Control.
    def _local_prefill(self, request: decode_pb2.RouteInfo) -> None:
        try:
            self.core.local_prefill(request.session_id, request.round)
        except SessionError as exc:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    def _tool_result(self, request: decode_pb2.ToolResultRequest) -> None:
        if request.input_tokens <= 0:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "input_tokens: must be >= 1")
        try:
            self.core.tool_result(request.session_id, request.call_id, request.input_tokens)
        except SessionError as exc:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    def _cancel(self, request: decode_pb2.CancelRequest) -> None:
        self.core.cancel(request.session_id, request.reason)

    def _control(self, request: decode_pb2.ControlRequest) -> None:
        kind = request.WhichOneof("call")
        if kind is None:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "call: one of local_prefill, tool_result, cancel is required")
        getattr(self, f"_{kind}")(getattr(request, kind))

    async def LocalPrefill(self, request: decode_pb2.RouteInfo, context) -> common_pb2.Ack:
        await abort_on_failure(context, lambda: self._local_prefill(request))
        return common_pb2.Ack()

    async def ToolResult(self, request: decode_pb2.ToolResultRequest, context) -> common_pb2.Ack:
        await abort_on_failure(context, lambda: self._tool_result(request))
        return common_pb2.Ack()

    async def Cancel(self, request: decode_pb2.CancelRequest, context) -> common_pb2.Ack:
        self._cancel(request)
        return common_pb2.Ack()

    async def Control(self, request_iterator, context):
        async for reply in serve_calls(request_iterator, self._control):
            yield reply

    async def Metrics(self, request, context) -> common_pb2.MetricsReply:
        core = self.core
        values = dict(core.metrics)
        values.update(
            kv_free_tokens=core.rt.pool.free_tokens,
            kv_capacity_tokens=core.rt.pool.capacity_tokens,
            kv_used_blocks=core.rt.pool.layout.num_blocks - core.rt.pool.free_blocks,
            active_sessions=len(core.sessions),
            queue_length=len(core.rt.queue),
            nixl_bytes_read=core.rt.transport.bytes_read,
            nixl_bytes_written=core.rt.transport.bytes_written,
        )
        return common_pb2.MetricsReply(worker_id=core.rt.cfg.worker_id, values=values)


async def amain(args: argparse.Namespace) -> None:
    logs.configure(f"decode:{args.worker_id}")
    profile = load_profile(args.profile)
    spec = policy_spec(args.policy)
    service = DecodeService()
    server, port, health = await grpcserver.start_server(
        f"{args.host}:{args.port}",
        lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(service, s),
        [decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name],
    )
    cfg = config_from_args(args, "decode", port)
    store = StateStore(await connect(cfg.redis_url), cfg.namespace)
    queue = make_queue(spec.decode_queue, profile, SLO(cfg.ttft_slo_s, cfg.itl_slo_s), cfg.tp,
                       window=cfg.reorder_window)
    rt = WorkerRuntime(cfg, store, pool_for(profile, cfg), queue)
    sidecar = sidecar_pb2_grpc.ToolSidecarStub(grpcserver.channel(args.sidecar)) if args.sidecar else None
    chunk = profile.prefill_chunk_tokens(cfg.tp) if args.chunked_prefill else 0
    service.core = DecodeCore(rt, make_engine(cfg.engine, profile, cfg.tp), sidecar, chunk_tokens=chunk,
                              cost=profile)
    service.core.start()
    await rt.start(sidecar=args.sidecar)
    write_ready_file(args.ready_file, port)
    log.info("decode worker serving", address=cfg.advertise, tp=cfg.tp, profile=profile.name,
             kv_capacity_tokens=rt.pool.capacity_tokens, policy=args.policy)

    async def on_stop() -> None:
        await service.core.stop()
        await rt.stop()

    await grpcserver.serve_until_signal(server, health, on_stop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ampd-decode", description="AMPD decode worker")
    add_worker_args(parser)
    parser.add_argument("--sidecar", default="", help="address of this worker's tool sidecar")
    parser.add_argument("--chunked-prefill", action="store_true",
                        help="split local prefills into chunks (size from the profile) interleaved with decode steps")
    args = parser.parse_args(argv)
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
