"""Decode worker gRPC server: a thin adapter over services.decode.worker.DecodeWorker."""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

import grpc
import structlog

from ampd import grpcserver, logs, metrics, tracing
from ampd.config import ConfigError, DeploymentConfig
from ampd.grpcserver import SESSION_OPEN, RpcFailure, abort_on_failure, serve_calls
from ampd.chat.template import ChatFormat
from ampd.chat.tokenizer import tokenizer_for
from ampd.engine import capabilities_of, check_available, make_engine, use_threads
from ampd.perf import load_profile
from ampd.policy import SLO, make_queue, policy_spec
from ampd.state import StateStore, connect
from ampd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, sidecar_pb2_grpc
from ampd.grpcserver import write_ready_file
from ampd.runtime import WorkerRuntime, add_worker_args, pool_for, worker_config
from services.decode.tiersize import available_memory_bytes, check_host_tier
from ampd.trust import attach_token, token_matches
from ampd.policy.kvtier import KVTierConfig
from ampd.worker import DecodeCore, HostTier
from ampd.validate import InvalidArgument, validate_attach, validate_reason, validate_turn
from services.decode.session import EventsGone, InvalidTurn, NotOpen, NotPermitted, SessionError, take_events
from services.decode.worker import DecodeWorker

log = structlog.get_logger()


class DecodeService(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self) -> None:
        self.core: DecodeWorker | None = None
        self.script_tools = DeploymentConfig().script_tools  # Attach is reachable without the coordinator

    async def Attach(self, request: decode_pb2.AttachRequest, context: grpc.aio.ServicerContext):
        core = self.core
        try:
            validate_attach(request.arrival, request.open, self.script_tools)
            if not request.session_secret:
                raise InvalidArgument("session_secret: required")
            sid, wid = request.open.session_id, core.rt.cfg.worker_id
            # before anything is allocated: only the coordinator that admitted the session here
            # (it read this worker's task key from the registry) can open it
            if not token_matches(attach_token(core.rt.task_key, sid, wid, request.session_secret),
                                 request.attach_token):
                raise NotPermitted(f"attach_token: not minted for session {sid!r} on {wid!r}")
            s = core.open(request)
        except (InvalidArgument, InvalidTurn) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotPermitted as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except SessionError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        async for out in self._stream(s, context, request.first_seq, None):
            yield out

    async def Reattach(self, request: decode_pb2.ReattachRequest, context: grpc.aio.ServicerContext):
        """A coordinator takes over a session whose own was lost (decode.proto Reattach)."""
        core = self.core
        sid, wid = request.session_id, core.rt.cfg.worker_id
        try:
            if not request.session_secret:
                raise InvalidArgument("session_secret: required")
            if not token_matches(attach_token(core.rt.task_key, sid, wid, request.session_secret),
                                 request.attach_token):
                raise NotPermitted(f"attach_token: not minted for session {sid!r} on {wid!r}")
            s, state = core.attachments.reattach(sid, request.session_secret, request.after_seq)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotPermitted as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except NotOpen as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except EventsGone as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        log.info("session reattached", session=sid, after_seq=request.after_seq, seq=state.seq)
        async for out in self._stream(s, context, request.after_seq, state):
            yield out

    async def _stream(self, s, context: grpc.aio.ServicerContext, after: int, state):
        """The session's events after number ``after`` until it ends (or another stream takes it
        over), those ready together in one message; ``state`` goes with the first (Reattach)."""
        core = self.core
        me = core.attachments.attached(s)
        try:
            # the session is open: the coordinator sends its Control requests only after this
            await context.send_initial_metadata((SESSION_OPEN,))
            while True:
                if s.owner is not me:
                    await context.abort(grpc.StatusCode.ABORTED, f"session {s.session_id!r} was reattached "
                                                                 "through another coordinator")
                batch, seq, failed = take_events(s, after)
                if batch or state is not None:
                    out = decode_pb2.DecodeEvents(events=batch)
                    if state is not None:
                        out.state.CopyFrom(state)
                        state = None
                    yield out
                    after = seq
                    if seq > s.sent:
                        s.sent = seq
                    if batch and batch[-1].HasField("done"):
                        return
                if failed is not None:
                    s.sent = seq
                    await context.abort(grpc.StatusCode[failed.code], failed.error)
                if not batch:
                    s.notify.clear()
                    await s.notify.wait()
        finally:
            core.attachments.detached(s, me)

    # The routes, Turn, Close and Cancel: one body each, served on Control (and some as unary calls).
    def _local_prefill(self, request: decode_pb2.RouteInfo) -> None:
        with _statuses():
            self.core.local_prefill(request.session_id, request.round, request.session_secret)

    def _remote_prefill(self, request: decode_pb2.RouteInfo) -> None:
        with _statuses():
            if not request.prefill_worker:
                raise InvalidArgument("remote_prefill.prefill_worker: required")
            self.core.remote_prefill(request.session_id, request.round, request.session_secret,
                                     request.prefill_worker)

    def _turn(self, request: decode_pb2.TurnRequest) -> None:
        with _statuses():
            validate_turn(request.turn, "turn", self.script_tools)
            if request.session_id not in self.core.sessions:
                if self.core.stopping:  # it ended its sessions just now: the coordinator moves this one too
                    raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.core.rt.cfg.worker_id} "
                                                                  "shutting down")
                raise NotOpen(f"session_id: {request.session_id!r} is not open on this worker")
            self.core.turn(request.session_id, request.turn, request.session_secret,
                           request.route if request.HasField("route") else None)

    def _close(self, request: decode_pb2.CloseRequest) -> None:
        with _statuses():
            self.core.close_session(request.session_id, request.session_secret)

    def _cancel(self, request: decode_pb2.CancelRequest) -> None:
        with _statuses():
            validate_reason(request.reason, "reason")
            self.core.cancel(request.session_id, request.reason, request.session_secret)

    def _stop(self, request: decode_pb2.StopRoundRequest) -> None:
        with _statuses():
            self.core.stop_round(request.session_id, request.session_secret)

    def _control(self, request: decode_pb2.ControlRequest) -> None:
        kind = request.WhichOneof("call")
        if kind is None:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                             "call: one of local_prefill, remote_prefill, turn, stop, close, cancel is required")
        getattr(self, f"_{kind}")(getattr(request, kind))

    async def LocalPrefill(self, request: decode_pb2.RouteInfo, context) -> common_pb2.Ack:
        await abort_on_failure(context, lambda: self._local_prefill(request))
        return common_pb2.Ack()

    async def Cancel(self, request: decode_pb2.CancelRequest, context) -> common_pb2.Ack:
        await abort_on_failure(context, lambda: self._cancel(request))
        return common_pb2.Ack()

    async def Control(self, request_iterator, context):
        async for reply in serve_calls(request_iterator, self._control):
            yield reply

    async def Metrics(self, request, context) -> common_pb2.MetricsReply:
        core = self.core
        values = dict(core.metrics)
        values.update(
            active_sessions=len(core.sessions),
            queue_length=len(core.core.queue),
            queue_pops_choice=core.core.queue.pops_choice,
            queue_pops_reordered=core.core.queue.pops_reordered,
            kv_overcommits=core.core.kv_overcommits,
            **metrics.worker_values(core.rt),
        )
        if core.tier is not None:
            values.update(core.tier.metrics())
        values.update(core.prefix.gauges())
        return common_pb2.MetricsReply(worker_id=core.rt.cfg.worker_id, values=values)


@contextmanager
def _statuses():
    """A request's failure as the status it answers with."""
    try:
        yield
    except (InvalidArgument, InvalidTurn) as exc:
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    except NotOpen as exc:  # the worker lost it (restarted, fenced): the coordinator moves it
        raise RpcFailure(grpc.StatusCode.NOT_FOUND, str(exc)) from None
    except NotPermitted as exc:
        raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None
    except SessionError as exc:
        raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None


def chat_format(cfg) -> ChatFormat | None:
    """Text for a real engine whose model has a tokenizer: stop strings and tool calls in the output.
    The mock's ids are not text; a model folder without a tokenizer serves ids only."""
    if not capabilities_of(cfg.engine).text_output:
        return None
    try:
        return ChatFormat(tokenizer_for(cfg.engine, cfg.model))
    except ValueError as exc:
        log.warning("no tokenizer: stop strings and tool-call parsing are off", model=cfg.model, error=str(exc))
        return None


async def amain(args: argparse.Namespace) -> None:
    logs.configure(f"decode:{args.worker_id}")
    grpcserver.set_tokens(args.auth_token, args.internal_token)
    profile = load_profile(args.profile)
    spec = policy_spec(args.policy)
    service = DecodeService()
    service.script_tools = tuple(args.script_tools)
    server, port, health = await grpcserver.start_server(
        f"{args.host}:{args.port}",
        lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(service, s),
        [decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name],
    )
    cfg = worker_config(args, "decode", port)
    if args.prefix_sharing and not cfg.prefix_sharing:
        log.info("prefix sharing is the engine's own prefix cache", engine=cfg.engine)
    engine = make_engine(cfg.engine, profile, cfg.tp, cfg.model, kv_store={"redis_url": cfg.redis_url, "namespace": cfg.namespace, "worker": cfg.worker_id})
    pool = pool_for(profile, cfg, engine)
    session_tokens = min(engine.max_context, pool.capacity_tokens)
    host_pool = check_host_tier(cfg.kv_host_mb, pool.block_tokens, pool.bytes_per_token, session_tokens, cfg.engine,
                                not engine.capabilities.needs_token_ids, cfg.kv_offload_pressure,
                                ratio=cfg.kv_host_ratio, device_bytes=pool.capacity_tokens * pool.bytes_per_token,
                                available_bytes=available_memory_bytes())  # before Redis
    if host_pool.note:
        log.warning(host_pool.note)
    log.info("host kv tier", mb=round(host_pool.mb, 2), source=host_pool.source)
    store = StateStore(await connect(cfg.redis_url), cfg.namespace)
    queue = make_queue(spec.decode_queue, profile, SLO(cfg.ttft_slo_s, cfg.itl_slo_s), cfg.tp,
                       window=cfg.reorder_window)
    rt = WorkerRuntime(cfg, store, pool)
    sidecar = sidecar_pb2_grpc.ToolSidecarStub(grpcserver.channel(cfg.sidecar)) if cfg.sidecar else None
    chunk = profile.prefill_chunk_tokens(cfg.tp) if cfg.chunked_prefill else 0
    core = DecodeCore(cfg.worker_id, cfg.tp, profile, queue, kv_capacity_tokens=rt.pool.capacity_tokens,
                      window_s=cfg.window_s, chunk_tokens=chunk, kv_admission=cfg.kv_admission,
                      kv_evict=cfg.kv_evict, step_by_step=True,
                      tier=HostTier.from_mb(host_pool.mb, pool.block_tokens, pool.bytes_per_token, session_tokens,
                                            KVTierConfig(offload_pressure=cfg.kv_offload_pressure),
                                            prefetch_early=cfg.kv_prefetch_early))
    rt.kv_host_tokens = core.tier.host_tokens if core.tier is not None else 0
    service.core = DecodeWorker(rt, engine, core, sidecar, chat_format(cfg))
    service.core.reattach_grace_s = args.reattach_grace
    service.core.start()
    await rt.start(sidecar=cfg.sidecar)
    metrics_port = metrics.serve(args.host, args.metrics_port,
                                 [metrics.rpc_collector(service, "decode", {"worker": cfg.worker_id})])
    write_ready_file(args.ready_file, port, metrics_port)
    log.info("decode worker serving", address=cfg.advertise, metrics_port=metrics_port, tp=cfg.tp, profile=profile.name,
             kv_capacity_tokens=rt.pool.capacity_tokens, policy=args.policy)

    async def on_stop() -> None:
        await rt.leave()  # out of routing first: no new session binds here while it stops
        await service.core.stop()
        if service.core.tier is not None:
            await service.core.tier.stop()  # after the sessions ended: their moves are over
        await rt.stop()

    await grpcserver.serve_until_signal(server, health, on_stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-decode", description="AMPD decode worker")
    add_worker_args(parser, "decode")
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        worker_config(args, "decode", args.port)  # bad settings fail before a port is bound
        use_threads(args.worker_threads)
        check_available(args.engine, args.model)
        tracing.setup("decode", args.otlp_endpoint, instance=args.worker_id)
    except (ConfigError, ValueError) as exc:
        sys.exit(f"ampd-decode: error: {exc}")
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
