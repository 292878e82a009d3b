"""Coordinator gRPC server: binds sessions, routes every prefill, streams events to clients."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections import Counter

import grpc
import structlog

from ampd import grpcserver, logs, metrics
from ampd.config import SERVICE_SETTINGS, ConfigError, CoordinatorSettings, add_flags, env_name
from ampd.deployment import check_names
from ampd.perf import load_profile
from ampd.policy import SLO, PrefillTask, make_router, policy_spec
from ampd.state import StateStore, connect
from ampd.v1 import (
    common_pb2, coordinator_pb2, coordinator_pb2_grpc, decode_pb2, decode_pb2_grpc, prefill_pb2,
    prefill_pb2_grpc,
)
from ampd.grpcserver import write_ready_file
from ampd.trust import new_secret
from ampd.validate import stream_message_error, validate_reason
from services.coordinator.admission import Admission, Refused
from services.coordinator.core import (
    Cluster, InvalidArgument, route, turn_kv_tokens, validate_open, validate_turn,
)

log = structlog.get_logger()


class _Rejected(grpc.aio.AioRpcError):
    """A client message this coordinator refused itself (it ends the session like a worker's refusal)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Stubs:
    """One channel per worker address, reused by every session, and one call stream per worker for
    the per-round requests (LocalPrefill, ToolResult, Cancel; Submit): see grpcserver.CallStream."""

    def __init__(self) -> None:
        self._decode: dict[str, decode_pb2_grpc.DecodeWorkerStub] = {}
        self._prefill: dict[str, prefill_pb2_grpc.PrefillWorkerStub] = {}
        self._control: dict[str, grpcserver.CallStream] = {}
        self._submit: dict[str, grpcserver.CallStream] = {}

    def control(self, address: str) -> grpcserver.CallStream:
        """DecodeWorker.Control of the worker at `address`: send decode_pb2.ControlRequest."""
        if address not in self._control:
            self._control[address] = grpcserver.CallStream(self.decode(address).Control)
        return self._control[address]

    def submit(self, address: str) -> grpcserver.CallStream:
        """PrefillWorker.SubmitStream of the worker at `address`: send prefill_pb2.SubmitRequest."""
        if address not in self._submit:
            self._submit[address] = grpcserver.CallStream(self.prefill(address).SubmitStream)
        return self._submit[address]

    def decode(self, address: str) -> decode_pb2_grpc.DecodeWorkerStub:
        if address not in self._decode:
            self._decode[address] = decode_pb2_grpc.DecodeWorkerStub(grpcserver.channel(address))
        return self._decode[address]

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillWorkerStub:
        if address not in self._prefill:
            self._prefill[address] = prefill_pb2_grpc.PrefillWorkerStub(grpcserver.channel(address))
        return self._prefill[address]


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, store: StateStore, router, policy: str, stats_mode: str = "push") -> None:
        self.store = store
        self.cluster = Cluster(store, stats_mode)
        self.router = router
        self.policy = policy
        self.stubs = Stubs()
        self.live: set[str] = set()
        self.counters: Counter[str] = Counter()
        self.route_read_ms_total = 0.0
        self.labels: dict[str, str] = {"policy": policy}
        self.admission = Admission(CoordinatorSettings().admission_wait, CoordinatorSettings().admission_queue)
        self.rounds = metrics.RoundMetrics()  # TTFT/ITL histograms of /metrics

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: the first message must open the session")
        if not first.HasField("open"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: the first message must open the session")
        o = first.open
        try:
            validate_open(o)
        except InvalidArgument as exc:
            self.counters["sessions_rejected"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sid = o.session_id
        if sid in self.live:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"open.session_id: {sid!r} is already live")
        arrival = time.time()
        self.live.add(sid)  # (while it waits for admission too: the id is taken)
        need = turn_kv_tokens(o.turn, o.limits.max_output_tokens) + self._block_tokens()
        try:
            decode_id = await self.admission.admit(need, self._rooms)
        except (Refused, LookupError) as exc:
            self.live.discard(sid)
            refused = isinstance(exc, Refused)
            self.counters["sessions_refused" if refused else "sessions_unavailable"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED if refused else grpc.StatusCode.UNAVAILABLE,
                                f"admission: {exc}")
        except BaseException:
            self.live.discard(sid)
            raise
        promised = [need]  # released when the session ends, whatever ends it
        info = self.cluster.infos[decode_id]
        self.counters["sessions_opened"] += 1
        decode_stub = self.stubs.decode(info.address)
        secret = new_secret()  # the session's credential on the decode worker
        call = decode_stub.Attach(decode_pb2.AttachRequest(open=o, arrival=arrival, session_secret=secret))
        # The session record is written while the decode worker opens the session, not before.
        # (Round 0's route record, which may land first, writes the same round.)
        record = asyncio.create_task(
            self.store.put_session(sid, {"decode_worker": decode_id, "arrival": arrival, "round": 0}))
        routes: dict[int, tuple[str, str, bool]] = {}
        control = self.stubs.control(info.address)
        rejected: list[grpc.aio.AioRpcError] = []
        reader = asyncio.create_task(self._client_messages(request_iterator, control, sid, secret, call, rejected,
                                                           decode_id, promised, o.limits.max_output_tokens))
        first_event = True
        try:
            async for ev in call:
                kind = ev.WhichOneof("event")
                if kind == "prefill_task":
                    await self._route(sid, secret, decode_id, info.tp, control, ev.prefill_task, routes)
                    continue
                out = coordinator_pb2.SessionEvent(session_id=sid)
                if first_event:
                    out.decode_worker = decode_id
                    first_event = False
                if kind == "tokens":
                    out.tokens.CopyFrom(ev.tokens)
                elif kind == "tool_call":
                    out.tool_call.CopyFrom(ev.tool_call)
                elif kind == "turn_end":
                    out.turn_end.CopyFrom(ev.turn_end)
                elif kind == "round_end":
                    out.round_end.CopyFrom(ev.round_end)
                    self._annotate(out.round_end.timing, routes)
                    self.rounds.observe(out.round_end.timing)
                elif kind == "done":
                    out.done.CopyFrom(ev.done)
                    for t in out.done.rounds:
                        self._annotate(t, routes)
                    self.counters["sessions_completed"] += 1
                    # Forget the session before telling the client: a client that checks right after
                    # SessionDone (or cancels its stream) must find nothing left behind.
                    self.live.discard(sid)
                    await record
                    await self.store.delete_session(sid)
                yield out
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if not rejected and isinstance(exc, asyncio.CancelledError):
                raise  # the client went away
            self.counters["sessions_failed"] += 1
            if rejected:  # a bad turn (the decode call was cancelled): the client gets the turn's error
                exc = rejected[0]
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED and context.cancelled():
                return
            if rejected or code == grpc.StatusCode.INVALID_ARGUMENT:  # a client message refused: as it was
                await context.abort(code, exc.details())
            await context.abort(code if code != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL,
                                f"decode worker {decode_id}: {exc.details()}")
        finally:
            reader.cancel()
            call.cancel()
            self.admission.release(decode_id, promised[0])
            self.live.discard(sid)
            await asyncio.gather(record, return_exceptions=True)  # a put must not outlive the delete
            await self.store.delete_session(sid)

    @staticmethod
    def _annotate(t: common_pb2.RoundTiming, routes: dict[int, tuple[str, str, bool]]) -> None:
        if t.round in routes:
            worker, reason, _ = routes[t.round]
            t.route_reason = reason

    async def _rooms(self) -> list:
        """The live decode workers for admission, each with its KV capacity as its room."""
        view = await self.cluster.view()
        infos = self.cluster.infos
        return [dataclasses.replace(v, kv_free_tokens=infos[wid].kv_capacity_tokens)
                for wid, v in view.decode.items() if wid in infos]

    def _block_tokens(self) -> int:
        """A session's last KV block may be partly empty: its promise counts one block more."""
        return max((i.layout.get("block_tokens", 0) for i in self.cluster.infos.values()), default=0)

    async def _client_messages(self, request_iterator, control: grpcserver.CallStream, sid: str, secret: str,
                               call, rejected: list, decode_id: str, promised: list[int], max_output: int) -> None:
        """The client's next turns, Close and Cancel while its session runs. A rejected message ends
        the session with its error (INVALID_ARGUMENT naming the field, or FAILED_PRECONDITION)."""
        closing = False
        try:
            # Control requests may overtake the Attach on another stream: wait until the decode
            # worker has opened the session (it sends its headers then, or ends the call).
            await call.initial_metadata()
            async for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                error = stream_message_error(kind, closing)
                try:
                    if error:
                        raise InvalidArgument(error)
                    if kind == "turn":
                        validate_turn(msg.turn, "turn")
                    elif kind == "cancel":
                        validate_reason(msg.cancel.reason, "cancel.reason")
                except InvalidArgument as exc:
                    code = grpc.StatusCode.FAILED_PRECONDITION if closing else grpc.StatusCode.INVALID_ARGUMENT
                    rejected.append(_Rejected(code, str(exc)))
                    call.cancel()
                    return
                if kind == "turn":
                    more = turn_kv_tokens(msg.turn, max_output)
                    self.admission.add(decode_id, more)
                    promised[0] += more
                    req = decode_pb2.ControlRequest(turn=decode_pb2.TurnRequest(
                        session_id=sid, turn=msg.turn, session_secret=secret))
                elif kind == "close":
                    closing = True
                    req = decode_pb2.ControlRequest(close=decode_pb2.CloseRequest(session_id=sid, session_secret=secret))
                else:
                    req = decode_pb2.ControlRequest(cancel=decode_pb2.CancelRequest(
                        session_id=sid, reason=msg.cancel.reason, session_secret=secret))
                try:
                    await control.call(req)
                except grpc.aio.AioRpcError as exc:
                    if kind == "close" and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        return  # the session already ended
                    rejected.append(exc)
                    call.cancel()
                    return
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            raise
        # The client half-closed its side: the session ends after its current turn.
        try:
            await control.call(decode_pb2.ControlRequest(close=decode_pb2.CloseRequest(
                session_id=sid, session_secret=secret)))
        except grpc.aio.AioRpcError:
            pass  # the session already ended

    async def _route(self, sid, secret, decode_id, decode_tp, control, need: common_pb2.PrefillTask, routes) -> None:
        t0 = time.perf_counter()
        view = await self.cluster.view()
        req = PrefillTask(sid, need.round, need.l_hist, need.l_incr, need.input_ready, decode_id, decode_tp)
        decision = route(self.router, view, req, time.time())
        decide_ms = (time.perf_counter() - t0) * 1e3
        self.route_read_ms_total += view.read_s * 1e3
        self.counters[f"route_{decision.reason}"] += 1
        # The session record is written while the prefill is handed over, not before it.
        record = asyncio.create_task(self.store.update_session(
            sid, {"round": need.round, "route": decision.reason, "prefill_worker": decision.target}))
        try:
            if not decision.local:
                target = self.cluster.infos.get(decision.target)
                try:
                    # The task goes on as the decode worker sent it, bound to the worker this
                    # coordinator bound the session to.
                    need.session_id, need.decode_worker, need.decode_tp = sid, decode_id, decode_tp
                    await self.stubs.submit(target.address).call(prefill_pb2.SubmitRequest(task=need))
                    self.counters["prefills_remote"] += 1
                except (grpc.aio.AioRpcError, AttributeError) as exc:
                    # A prefill worker that vanished must not lose the round: run it locally.
                    log.warning("remote prefill submit failed; running locally", session=sid,
                                target=decision.target, error=str(exc))
                    self.counters["route_fallback-local"] += 1
                    decision = decision.__class__(decode_id, True, "fallback-local", decision.estimates)
            if decision.local:
                await control.call(decode_pb2.ControlRequest(local_prefill=decode_pb2.RouteInfo(
                    session_id=sid, round=need.round, reason=decision.reason, session_secret=secret)))
                self.counters["prefills_local"] += 1
            routes[need.round] = (decision.target, decision.reason, decision.local)
            log.info("route", session=sid, round=need.round, target=decision.target, local=decision.local,
                     reason=decision.reason, decide_ms=round(decide_ms, 3),
                     **{k: round(v, 4) for k, v in decision.estimates.items()})
        finally:
            await record

    async def Metrics(self, request, context) -> common_pb2.MetricsReply:
        values = {k: float(v) for k, v in self.counters.items()}
        values["sessions_live"] = len(self.live)
        values["sessions_waiting"] = self.admission.waiting
        values["route_redis_read_ms_total"] = self.route_read_ms_total
        lags = sorted(self.cluster.lag_s[-1000:])
        if lags:
            values["stats_lag_p50_ms"] = lags[len(lags) // 2] * 1e3
            values["stats_lag_max_ms"] = lags[-1] * 1e3
        return common_pb2.MetricsReply(worker_id="coordinator", values=values, labels=self.labels)


async def amain(args: argparse.Namespace) -> None:
    logs.configure("coordinator")
    grpcserver.set_auth_token(args.auth_token)
    profile = load_profile(args.profile)
    policy_spec(args.policy)  # an unknown name fails here, with the valid ones listed
    slo = SLO(args.ttft_slo, args.itl_slo)
    router = make_router(args.policy, profile, slo, seed=args.seed, alpha=args.alpha, beta=args.beta,
                         threshold_tokens=args.threshold_tokens, slack=args.slack or None)
    store = StateStore(await connect(args.redis_url), args.namespace)
    service = CoordinatorService(store, router, args.policy, args.stats_mode)
    service.admission = Admission(args.admission_wait, args.admission_queue)
    service.labels.update(profile=profile.name, ttft_slo=str(slo.ttft_s), itl_slo=str(slo.itl_s))
    await service.cluster.start()
    server, port, health = await grpcserver.start_server(
        f"{args.host}:{args.port}",
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, s),
        [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name],
        max_message=grpcserver.CLIENT_MAX_MESSAGE,  # clients: gRPC's default; workers take more
    )
    metrics_port = metrics.serve(args.host, args.metrics_port,
                                 [service.rounds, metrics.rpc_collector(service, "coordinator")])
    write_ready_file(args.ready_file, port, metrics_port)
    log.info("coordinator serving", address=f"{args.host}:{port}", metrics_port=metrics_port, policy=args.policy,
             profile=profile.name, ttft_slo=slo.ttft_s, itl_slo=slo.itl_s)
    await grpcserver.serve_until_signal(server, health, service.cluster.stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-coordinator", description="AMPD coordinator")
    add_flags(parser, SERVICE_SETTINGS["coordinator"], env=True)
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        if not args.redis_url:
            raise ConfigError(f"--redis-url ({env_name('redis_url')}): required")
        check_names(args)
    except ConfigError as exc:
        sys.exit(f"ampd-coordinator: error: {exc}")
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
