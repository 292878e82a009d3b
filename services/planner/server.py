"""Planner service: answers plan requests (ampd.planner) and serves the stored profiles.

Thin: the proto request becomes an ``ampd.planner.PlanRequest``; planning runs in a worker thread
(it is CPU-bound), one plan at a time, with one estimate cache for the process's life, so a second
plan of the same workload (another GPU count, rate or top K) reuses every estimate simulation.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import grpc
import structlog

from ampd import grpcserver, logs, metrics, tracing
from ampd.config import SERVICE_SETTINGS, ConfigError, add_flags
from ampd.grpcserver import write_ready_file
from ampd.v1 import planner_pb2, planner_pb2_grpc

log = structlog.get_logger()


class ProfileStore:
    """The shipped profiles plus every ``*.json`` profile in ``extra_dir`` (e.g. made by ``ampd profile``)."""

    def __init__(self, extra_dir: str = "") -> None:
        self.extra = Path(extra_dir) if extra_dir else None

    def _paths(self) -> dict[str, str]:
        from ampd.perf import list_profiles

        out = {name: name for name in list_profiles()}
        if self.extra is not None and self.extra.is_dir():
            for p in sorted(self.extra.glob("*.json")):
                out.setdefault(p.stem, str(p))
        return out

    def names(self) -> list[str]:
        return sorted(self._paths())

    def get(self, name: str):
        """The profile called ``name``; KeyError if none, ValueError if its file is malformed."""
        from ampd.perf import load_profile

        paths = self._paths()
        if name not in paths:
            raise KeyError(f"profile: no stored profile {name!r} (stored: {', '.join(sorted(paths))})")
        return load_profile(paths[name])


def parse_trace(text: str) -> list:
    """Sessions from a trace file's text; ValueError naming the line and field."""
    from ampd.workload.trace import session_from_obj

    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace_jsonl: line {i}: not JSON ({exc.msg})") from None
        out.append(session_from_obj(obj, f"trace_jsonl: line {i}"))
    return out


def _num(x: float) -> float:
    return x if math.isfinite(x) else -1.0


class PlannerService(planner_pb2_grpc.PlannerServicer):
    def __init__(self, store: ProfileStore) -> None:
        from ampd.planner import EstimateCache

        self.store = store
        self.cache = EstimateCache()
        self.lock = asyncio.Lock()
        self.plan_seconds = metrics.plan_histogram()

    async def ListProfiles(self, request, context) -> planner_pb2.ListProfilesReply:
        infos = []
        for name in self.store.names():
            try:
                p = self.store.get(name)
            except ValueError as exc:  # a malformed extra file: list the others, say why
                log.warning("profile skipped", name=name, error=str(exc))
                continue
            infos.append(planner_pb2.ProfileInfo(name=name, model=p.model, hardware=p.hardware, tps=list(p.tps)))
        return planner_pb2.ListProfilesReply(profiles=infos)

    async def GetProfile(self, request, context) -> planner_pb2.ProfileReply:
        try:
            p = self.store.get(request.name)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"profile: {exc}")
        return planner_pb2.ProfileReply(name=request.name, json=json.dumps(p.to_json(), indent=1))

    async def Plan(self, request, context) -> planner_pb2.PlanReply:
        from ampd.planner import PlanError, PlanRequest, plan
        from ampd.planner.plan import CHECK_SESSIONS, resolve_slo
        from ampd.workload import TraceError

        try:
            profile = self.store.get(request.profile)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"profile: {exc}")
        try:
            sessions = parse_trace(request.trace_jsonl)
        except (TraceError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not sessions:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "trace_jsonl: the trace has no sessions")
        t0 = time.monotonic()
        try:
            slo = resolve_slo(profile, sessions, int(request.gpus), request.ttft_slo_s or None,
                              request.itl_slo_s or None)
            req = PlanRequest(profile, sessions, int(request.gpus), slo, top=request.top or 3,
                              policy=request.policy or "ampd", colocated=not request.no_colocated,
                              mixed=not request.one_degree, all_gpus=request.all_gpus,
                              candidates=request.candidates,
                              check_sessions=request.check_sessions or CHECK_SESSIONS, seed=request.seed)
            async with self.lock:
                result = await asyncio.to_thread(plan, req, cache=self.cache)
        except PlanError as exc:
            # too few GPUs for any replica that holds the model is a precondition of the cluster, not a typo
            code = (grpc.StatusCode.FAILED_PRECONDITION if exc.field in ("gpus", "profile") and request.gpus
                    else grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, str(exc))
        seconds = time.monotonic() - t0
        self.plan_seconds.observe(seconds)
        doc = result.to_json(seconds)
        doc["profile"] = profile.name
        log.info("planned", profile=profile.name, gpus=request.gpus, seconds=round(seconds, 3),
                 best=f"{doc['top'][0]['prefill']}|{doc['top'][0]['decode']}" if doc["top"] else None)
        return planner_pb2.PlanReply(
            gpus=result.gpus, seconds=seconds, ttft_slo_s=slo.ttft_s, itl_slo_s=slo.itl_s,
            candidates_checked=result.candidates, json=json.dumps(doc),
            top=[planner_pb2.PlannedDeployment(
                prefill=e.deployment.prefill_spec, decode=e.deployment.decode_spec, p95_s=_num(e.p95_s),
                slo_attainment=e.slo_attainment, gpus=e.deployment.gpus, policy=e.policy,
                p95_itl_s=_num(e.p95_itl_s), estimated_worst_p95_over_slo=e.objective) for e in result.top])


async def amain(args: argparse.Namespace) -> None:
    logs.configure("planner")
    grpcserver.set_auth_token(args.auth_token)
    service = PlannerService(ProfileStore(args.profiles_dir))
    server, port, health = await grpcserver.start_server(
        f"{args.host}:{args.port}",
        lambda s: planner_pb2_grpc.add_PlannerServicer_to_server(service, s),
        [planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name],
    )
    metrics_port = metrics.serve(args.host, args.metrics_port, [service.plan_seconds])
    write_ready_file(args.ready_file, port, metrics_port)
    log.info("planner serving", port=port, metrics_port=metrics_port, profiles=service.store.names())
    await grpcserver.serve_until_signal(server, health)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-planner", description="AMPD planner service")
    add_flags(parser, SERVICE_SETTINGS["planner"], env=True)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        tracing.setup("planner", args.otlp_endpoint)
    except ConfigError as exc:
        sys.exit(f"ampd-planner: error: {exc}")
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
