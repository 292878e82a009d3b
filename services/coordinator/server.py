"""Coordinator gRPC server: binds sessions, routes every prefill, streams events to clients."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from collections import Counter

import grpc
import structlog

from ampd import grpcserver, logs, metrics, tracing
from ampd.config import (SERVICE_SETTINGS, ConfigError, CoordinatorSettings, DeploymentConfig, WorkerSettings,
                         add_flags, require)
from ampd.deployment import check_names
from ampd.perf import load_profile
from ampd.policy import SLO, make_router, policy_spec
from ampd.state import StateStore, connect
from ampd.state.prefixes import PrefixSets
from ampd.state.promises import Promises
from ampd.state.store import REDIS_ERRORS
from ampd.stubs import Stubs
from ampd.tasks import BackgroundTasks
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from ampd.grpcserver import REATTACH_HEADER, SESSION_OPEN, write_ready_file
from ampd.trust import reattach_token
from services.coordinator.core import Cluster, InvalidArgument, validate_open
from services.coordinator.admission import Admission
from services.coordinator.errors import SessionEnd
from services.coordinator.prefixes import PrefixChoice, prefix_choice
from services.coordinator.session import SessionRun

log = structlog.get_logger()


ORPHAN_SWEEP_POLLS = 20  # liveness polls (0.5 s each) between sweeps for orphaned session records
ORPHAN_SWEEP_S = 3.0  # the coordinator's liveness key's TTL


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, store: StateStore, router, policy: str, stats_mode: str = CoordinatorSettings.stats_mode,
                 migration_limit: int = CoordinatorSettings().migration_limit, cost=None,
                 fence_after: float = WorkerSettings.fence_after) -> None:
        self.store = store
        self.prefix_sets = PrefixSets(store.r, store.ns)  # the decode workers' prefix blocks (binding)
        self.cluster = Cluster(store, stats_mode, cost=cost, fence_after=fence_after)
        self.cluster.on_poll = self._on_poll
        self.cluster.on_fenced = self._fenced
        # A call to a worker that does not answer within this bound finds it stopped: the session
        # moves, or the round runs elsewhere (docs/deploy.md "Faults")
        self.call_timeout_s = fence_after
        self.runs: dict[str, SessionRun] = {}  # the live sessions, by id
        self.router = router
        self.policy = policy
        self.migration_limit = migration_limit
        self.script_tools = DeploymentConfig().script_tools  # what a client's Turn.script may run
        self.stubs = Stubs(self._connection_failed)
        self.live: set[str] = set()
        self.counters: Counter[str] = Counter()
        self.route_read_ms_total = 0.0
        self.labels: dict[str, str] = {"policy": policy}
        self.rounds = metrics.RoundMetrics()  # TTFT/ITL histograms of /metrics
        settings = CoordinatorSettings()
        self.admission = Admission(settings.admission_wait, settings.admission_queue)
        # prefill worker -> the sessions with a round submitted there and not yet answered
        self.remote: dict[str, dict[tuple[str, int], SessionRun]] = {}
        self._unrecorded: set[str] = set()  # session records whose delete failed (Redis was away)
        self._writes = BackgroundTasks()  # session record writes in flight
        # the sessions' decode-stream pumps and client readers, their cancels' replies, the re-routes
        # of a lost prefill worker's rounds: cancelled and awaited at shutdown (close)
        self.tasks = BackgroundTasks()
        # This coordinator's id on its session records; a record whose coordinator's liveness key
        # is gone (it died serving the session) is deleted by the next coordinator's sweep.
        self.instance = f"{os.getpid()}-{int(time.time() * 1000) % 10**9}"
        self._polls = 0
        # A lost coordinator's session records stay this long for their clients to reattach them
        self.reattach_grace_s = WorkerSettings.reattach_grace
        self._orphans_seen: dict[str, float] = {}  # orphaned record -> when a sweep first found it
        self.stopping = False  # stop(): the sessions are left on their workers for other coordinators

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        opened, failure = time.time(), ""  # for its span (tracing)
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: the first message must open the session")
        reattach = first.reattach if first.HasField("reattach") else None
        if not first.HasField("open") and reattach is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: the first message must open the session")
        if reattach is not None:  # its coordinator was lost: it goes on here (coordinator.proto ReattachSession)
            if not reattach.session_id or len(reattach.session_id) > 256:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reattach.session_id: 1 to 256 characters")
            o = common_pb2.OpenSession(session_id=reattach.session_id)
        else:
            o = first.open
            try:
                validate_open(o, script_tools=self.script_tools)
            except InvalidArgument as exc:
                self.counters["sessions_rejected"] += 1
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sid = o.session_id
        if sid in self.live:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"open.session_id: {sid!r} is already live")
        self.live.add(sid)
        self.counters["sessions_opened"] += 1
        # The session's headers go once it is bound, while its first round runs: its first event is
        # then a message alone (headers with it took ~0.4 ms more on that event's path, measured).
        # its headers carry the client's reattach token (ampd.coordinators): a session whose
        # coordinator is lost before its first event can go on through another one too
        run = self.runs[sid] = SessionRun(
            self, sid, o, request_iterator, reattach=reattach,
            on_open=lambda: context.send_initial_metadata((SESSION_OPEN, (REATTACH_HEADER, reattach_token(run.secret)))))
        try:
            async for batch in run.run():
                if batch[-1].HasField("done"):
                    # Forget the session before telling the client: a client that checks right after
                    # SessionDone (or cancels its stream) must find nothing left behind.
                    self.counters["sessions_completed"] += 1
                    self.live.discard(sid)
                    await self.forget_record(sid)
                yield coordinator_pb2.SessionEvents(events=batch)
        except SessionEnd as end:
            failure = end.details
            refused = end.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not run.admitted
            self.counters["sessions_refused" if refused else "sessions_failed"] += 1
            await context.abort(end.code, end.details)
        finally:
            if tracing.on:
                tracing.session_span(sid, opened, time.time(), {"ampd.decode_worker": run.decode_id,
                                                                "ampd.moves": run.log.moves},
                                     tracing.from_metadata(context.invocation_metadata()), failure)
            self.runs.pop(sid, None)
            if sid in self.live:
                self.live.discard(sid)
                if not run.taken_over:  # (a record another coordinator holds now stays)
                    await self.forget_record(sid)

    # ---------------------------------------------------------------------------- admission
    async def rooms(self) -> tuple[list, tuple]:
        """For admission: the live decode workers, each with its KV capacity as its room (and its
        host KV tier's, which admission promises beyond it), and the live prefill workers."""
        view = await self.cluster.view()
        infos = self.cluster.infos
        return ([dataclasses.replace(v, kv_free_tokens=infos[wid].kv_capacity_tokens,
                                     kv_host_tokens=infos[wid].kv_host_tokens)
                 for wid, v in view.decode.items() if wid in infos], view.prefill)

    async def prefix_choice(self, run: SessionRun) -> PrefixChoice | None:
        """For a new session's binding: its prompt's match on each decode worker that shares
        prefixes (services/coordinator/prefixes.py), or None."""
        tokens = run.o.turn.token_ids
        if not tokens:
            return None
        slo = self.admission.book.slo
        return await prefix_choice(self.prefix_sets, self.cluster.infos, run.sid, tokens,
                                   slo.itl_s if slo is not None else None, self.counters, run.o.prefix_scope)

    def block_tokens(self) -> int:
        """A session's last KV block may be partly empty: its promise counts one block more."""
        return max((i.layout.get("block_tokens", 0) for i in self.cluster.infos.values()), default=0)

    # ------------------------------------------------------------------- session records (Redis)
    def record(self, sid: str, fields: dict) -> None:
        """Writes the session's record in the background: a Redis outage must not stall a session."""
        self._writes.spawn(self._write(self.store.update_session(sid, {**fields, "coordinator": self.instance})))

    async def _write(self, op) -> bool:
        try:
            await asyncio.wait_for(op, 2.0)
            return True
        except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
            log.warning("session record not written", error=str(exc) or type(exc).__name__)
            return False

    async def forget_record(self, sid: str) -> None:
        # the record's writes in flight land first, then the delete (it must not be rewritten after)
        await self._writes.wait()
        if not await self._write(self.store.delete_session(sid)):
            self._unrecorded.add(sid)  # deleted on a later liveness poll, once Redis answers

    async def stop(self) -> None:
        self.stopping = True
        await self.cluster.stop()  # no poll renews the liveness key after this
        # The key goes now, not at its TTL: nothing of a stopped coordinator stays in Redis, and the
        # records of sessions it still served are orphans at once for the next coordinator's sweep.
        await self._write(self.store.coordinator_gone(self.instance))

    async def close(self) -> None:
        """After the server stopped: cancels and awaits what still runs in the background, and
        closes the channels to the workers."""
        await self.tasks.close()
        await self.admission.close()
        await self._writes.close()
        await self.stubs.close()

    async def _on_poll(self) -> None:
        await self.store.coordinator_alive(self.instance, ORPHAN_SWEEP_S)
        self._polls += 1
        if self._polls % ORPHAN_SWEEP_POLLS == 1:
            # A record stays reattach_grace after its coordinator is found gone: its client may
            # reattach the session through this coordinator or another meanwhile.
            now = time.monotonic()
            found = [sid for sid in await self.store.orphan_sessions() if sid not in self.live]
            seen = self._orphans_seen
            self._orphans_seen = {sid: seen.get(sid, now) for sid in found}
            orphans = [sid for sid, t in self._orphans_seen.items() if now - t >= self.reattach_grace_s]
            if orphans:
                log.info("deleting the records of sessions whose coordinator is gone", sessions=len(orphans))
                await self.store.delete_sessions(orphans)
                for sid in orphans:
                    del self._orphans_seen[sid]
        if self._unrecorded:
            gone = set(self._unrecorded)
            await self.store.delete_sessions(gone)
            self._unrecorded -= gone
        for wid in list(self.remote):  # a prefill worker whose liveness key expired: re-route its work
            if self.cluster.live is not None and wid not in self.cluster.live and wid in self.cluster.infos:
                self._prefill_lost(wid)

    # ---------------------------------------------------------------------------- lost workers
    def _connection_failed(self, address: str) -> None:
        """A call stream to the worker at ``address`` failed on its connection."""
        for wid, info in list(self.cluster.infos.items()):
            if info.address == address:
                self.cluster.mark_lost(wid)
                if info.kind == "prefill":
                    self._prefill_lost(wid)

    def _fenced(self, info) -> None:
        """The worker of ``info`` went unheard for --fence-after and was fenced (docs/deploy.md
        "Faults"): it is handled like a dead one. Its sessions move to another decode worker (or
        fail, past their migration limit); the rounds submitted to a prefill worker run on their
        decode workers. Its channel closes, so no call to it waits for its deadline."""
        worker = info.worker_id
        self.counters["workers_fenced"] += 1
        if info.kind == "prefill":
            self._prefill_lost(worker)
        else:
            why = f"decode worker {worker} fenced: not heard from for {self.call_timeout_s:g} s"
            for run in list(self.runs.values()):
                if run.bound and run.decode_id == worker:
                    run.fenced(why)
        self.stubs.drop(info.address)

    def remember_remote(self, run: SessionRun, worker: str, rnd: int) -> None:
        self.remote.setdefault(worker, {})[(run.sid, rnd)] = run

    def forget_remote(self, run: SessionRun, rnd: int | None = None) -> None:
        if rnd is not None:  # (a few times a round: one lookup, not a scan of the worker's tasks)
            worker = run.routing.remote.pop(rnd, None)
            tasks = self.remote.get(worker) if worker is not None else None
            if tasks is not None:
                tasks.pop((run.sid, rnd), None)
                if not tasks:
                    del self.remote[worker]
            return
        for worker in list(run.routing.remote.values()):
            if worker is None:
                continue
            tasks = self.remote.get(worker, {})
            for key in [k for k in tasks if k[0] == run.sid]:
                del tasks[key]
            if not tasks:
                self.remote.pop(worker, None)

    def _prefill_lost(self, worker: str) -> None:
        """Every round submitted to ``worker`` and not answered runs on its decode worker instead."""
        tasks = self.remote.pop(worker, {})
        for (sid, rnd), run in tasks.items():
            self.tasks.spawn(run.routing.reroute(rnd, worker))

    async def Metrics(self, request, context) -> common_pb2.MetricsReply:
        values = {k: float(v) for k, v in self.counters.items()}
        values["sessions_live"] = len(self.live)
        values["sessions_waiting"] = self.admission.waiting
        values["kv_promised_tokens"] = await self.admission.promised_total()
        values["route_redis_read_ms_total"] = self.route_read_ms_total
        lags = sorted(self.cluster.lag_s[-1000:])
        if lags:
            values["stats_lag_p50_ms"] = lags[len(lags) // 2] * 1e3
            values["stats_lag_max_ms"] = lags[-1] * 1e3
        return common_pb2.MetricsReply(worker_id="coordinator", values=values, labels=self.labels)


async def amain(args: argparse.Namespace) -> None:
    logs.configure("coordinator")
    grpcserver.set_tokens(args.auth_token, args.internal_token)
    profile = load_profile(args.profile)
    policy_spec(args.policy)  # an unknown name fails here, with the valid ones listed
    slo = SLO(args.ttft_slo, args.itl_slo)
    router = make_router(args.policy, profile, slo, seed=args.seed, alpha=args.alpha, beta=args.beta,
                         threshold_tokens=args.threshold_tokens, slack=args.slack or None)
    store = StateStore(await connect(args.redis_url), args.namespace)
    service = CoordinatorService(store, router, args.policy, args.stats_mode, args.migration_limit, cost=profile,
                                 fence_after=args.fence_after)
    service.script_tools = tuple(args.script_tools)
    # its promises shared with the deployment's other coordinators (ampd.state.promises)
    service.admission = Admission(args.admission_wait, args.admission_queue, args.admission, profile, slo,
                                  promises=Promises(store.r, args.namespace, store.coordinator_key("")))
    service.reattach_grace_s = args.reattach_grace
    service.labels.update(profile=profile.name, ttft_slo=str(slo.ttft_s), itl_slo=str(slo.itl_s))
    await service.cluster.start()
    desc = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
    server, port, health = await grpcserver.start_server(
        f"{args.host}:{args.port}",
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, s),
        [desc.full_name],
        max_message=grpcserver.CLIENT_MAX_MESSAGE,  # clients: gRPC's default; workers take more
        # the client-facing API: auth_token governs it, not the internal secret
        public=[f"/{desc.full_name}/{m.name}" for m in desc.methods],
    )
    metrics_port = metrics.serve(args.host, args.metrics_port,
                                 [service.rounds, metrics.rpc_collector(service, "coordinator")])
    write_ready_file(args.ready_file, port, metrics_port)
    log.info("coordinator serving", address=f"{args.host}:{port}", metrics_port=metrics_port, policy=args.policy,
             profile=profile.name, ttft_slo=slo.ttft_s, itl_slo=slo.itl_s)
    try:
        await grpcserver.serve_until_signal(server, health, service.stop)
    finally:
        await service.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-coordinator", description="AMPD coordinator")
    add_flags(parser, SERVICE_SETTINGS["coordinator"], env=True)
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        require(args, "redis_url")
        check_names(args)
        tracing.setup("coordinator", args.otlp_endpoint)
    except ConfigError as exc:
        sys.exit(f"ampd-coordinator: error: {exc}")
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
