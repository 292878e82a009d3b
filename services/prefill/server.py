"""Prefill worker gRPC server: a thin adapter over services.prefill.worker.PrefillWorker."""
from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
import structlog

from ampd import grpcserver, logs, metrics, tracing
from ampd.config import ConfigError
from ampd.grpcserver import RpcFailure, abort_on_failure, serve_calls
from ampd.engine import check_available, make_engine, use_threads
from ampd.perf import load_profile
from ampd.policy import SLO, make_queue, policy_spec
from ampd.state import StateStore, connect
from ampd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from ampd.grpcserver import write_ready_file
from ampd.runtime import WorkerRuntime, add_worker_args, pool_for, worker_config
from ampd.worker import PrefillCore
from ampd.trust import task_token, token_matches
from ampd.validate import InvalidArgument, TaskTarget, validate_prefill_task
from services.prefill.worker import PrefillWorker

log = structlog.get_logger()

# Tasks one prefill worker queues at most; beyond it Submit answers RESOURCE_EXHAUSTED (the
# coordinator then runs the prefill on the session's decode worker).
MAX_QUEUED_TASKS = 4096


class PrefillService(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self) -> None:
        self.core: PrefillWorker | None = None
        self.tps: tuple[int, ...] = ()  # degrees the profile times transfers for

    async def _submit(self, request: common_pb2.PrefillTask) -> None:
        """Everything about a task is checked before it is queued: a task the loop cannot run (an
        unknown worker, a degree the profile cannot time, blocks outside the pool) is refused here,
        and one whose token is not its decode worker's is refused (it could name another session's
        blocks)."""
        core, tps = self.core, self.tps
        try:
            info = core.rt.peers.get(request.decode_worker)
            if info is None:  # not loaded yet: the fields first, then the lookup (it may go to Redis)
                validate_prefill_task(request, tps)
                try:
                    await core.rt.ensure_peer(request.decode_worker)
                except LookupError:
                    raise InvalidArgument(f"task.decode_worker: {request.decode_worker!r} is not a registered "
                                          "decode worker") from None
                info = core.rt.peers[request.decode_worker]
            # once, with the target: it checks every field the check without one does
            layout = info.layout
            validate_prefill_task(request, tps, TaskTarget(info.tp, layout["num_blocks"], layout["block_tokens"],
                                                           info.host_layout.get("num_blocks", 0)))
        except InvalidArgument as exc:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        key = bytes.fromhex(info.task_key) if info.task_key else b""
        if not key or not token_matches(task_token(key, request), request.task_token):
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"task.task_token: not minted by {request.decode_worker!r} for this task")
        if len(core.tasks) >= MAX_QUEUED_TASKS:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"task: {len(core.tasks)} tasks already queued here")
        try:
            core.submit(request)
        except ValueError as exc:
            raise RpcFailure(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None

    async def Submit(self, request: prefill_pb2.PrefillTask, context) -> common_pb2.Ack:
        await abort_on_failure(context, lambda: self._submit(request))
        # The worker's loop, just woken, starts the task before the answer is sent (SubmitStream's
        # serve_calls does the same): the answer only confirms the queueing.
        await asyncio.sleep(0)
        return common_pb2.Ack()

    async def SubmitStream(self, request_iterator, context):
        async for reply in serve_calls(request_iterator, lambda req: self._submit(req.task)):
            yield reply

    async def Metrics(self, request, context) -> common_pb2.MetricsReply:
        core = self.core
        values = dict(core.metrics)
        q = core.core.queue
        values.update(queue_length=len(q), queue_pops_choice=q.pops_choice, queue_pops_reordered=q.pops_reordered,
                      **metrics.worker_values(core.rt))
        return common_pb2.MetricsReply(worker_id=core.rt.cfg.worker_id, values=values)


async def amain(args: argparse.Namespace) -> None:
    logs.configure(f"prefill:{args.worker_id}")
    grpcserver.set_tokens(args.auth_token, args.internal_token)
    profile = load_profile(args.profile)
    spec = policy_spec(args.policy)
    service = PrefillService()
    service.tps = profile.tps
    server, port, health = await grpcserver.start_server(
        f"{args.host}:{args.port}",
        lambda s: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(service, s),
        [prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name],
    )
    cfg = worker_config(args, "prefill", port)
    store = StateStore(await connect(cfg.redis_url), cfg.namespace)
    queue = make_queue(spec.prefill_queue or "fcfs", profile, SLO(cfg.ttft_slo_s, cfg.itl_slo_s), cfg.tp,
                       window=cfg.reorder_window)
    engine = make_engine(cfg.engine, profile, cfg.tp, cfg.model, kv_store={"redis_url": cfg.redis_url, "namespace": cfg.namespace, "worker": cfg.worker_id})
    rt = WorkerRuntime(cfg, store, pool_for(profile, cfg, engine))
    core = PrefillCore(cfg.worker_id, cfg.tp, profile, queue, window_s=cfg.window_s, kv_overlap=cfg.kv_overlap,
                       kv_capacity_tokens=rt.pool.capacity_tokens)
    service.core = PrefillWorker(rt, engine, core)
    service.core.start()
    await rt.start()
    await rt.sync_peers()
    metrics_port = metrics.serve(args.host, args.metrics_port,
                                 [metrics.rpc_collector(service, "prefill", {"worker": cfg.worker_id})])
    write_ready_file(args.ready_file, port, metrics_port)
    log.info("prefill worker serving", address=cfg.advertise, metrics_port=metrics_port, tp=cfg.tp, profile=profile.name)

    async def on_stop() -> None:
        await rt.leave()  # out of routing first: no new task is sent here while it stops
        await service.core.stop()
        await rt.stop()

    await grpcserver.serve_until_signal(server, health, on_stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-prefill", description="AMPD prefill worker")
    add_worker_args(parser, "prefill")
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        worker_config(args, "prefill", args.port)  # bad settings fail before a port is bound
        use_threads(args.worker_threads)
        check_available(args.engine, args.model)
        tracing.setup("prefill", args.otlp_endpoint, instance=args.worker_id)
    except (ConfigError, ValueError) as exc:
        sys.exit(f"ampd-prefill: error: {exc}")
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
