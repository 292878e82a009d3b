"""Tool sidecar: runs a decode worker's tool calls off its decode loop."""
from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
import structlog

from ampd import grpcserver, logs, metrics, tracing
from ampd.config import SERVICE_SETTINGS, ConfigError, add_flags
from ampd.grpcserver import write_ready_file
from ampd.tools import BUILTIN, ToolInput, ToolLimits, ToolRegistry, call_budget, isolated
from ampd.validate import InvalidArgument, validate_tool_call
from ampd.v1 import common_pb2, sidecar_pb2, sidecar_pb2_grpc
from services.sidecar.pool import StartError, ToolProcesses

log = structlog.get_logger()


class SidecarService(sidecar_pb2_grpc.ToolSidecarServicer):
    def __init__(self, registry: ToolRegistry, name: str, limits: ToolLimits,
                 procs: ToolProcesses | None = None) -> None:
        self.registry = registry
        self.name = name
        self.limits = limits
        self.procs = procs  # None: no tool but replay is registered
        self.calls = 0
        self.failures = 0

    async def Call(self, request: sidecar_pb2.ToolCallRequest, context) -> sidecar_pb2.ToolCallResult:
        try:
            validate_tool_call(request.name, request.arguments, request.latency_s, request.result_tokens,
                               request.session_id)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        name = request.name or BUILTIN
        try:
            tool = self.registry.get(name)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: {exc.args[0]}")
        call = ToolInput(request.session_id, request.round,
                         json.loads(request.arguments) if request.arguments else {}, request.latency_s,
                         request.result_tokens)
        started = time.time()
        self.calls += 1
        if isolated(name) and self.procs is not None:
            out, error = await self.procs.call(name, call, call_budget(self.limits.wall_s, context.time_remaining()))
        else:  # replay only waits: it runs here
            out, error = await tool(call), ""
        if tracing.on:  # its span: the child of the decode worker's tool call (traceparent)
            parent = tracing.from_metadata(context.invocation_metadata()) or tracing.round_context(
                request.session_id, request.round)
            tracing.record("sidecar.call", started, time.time(), parent,
                           {"ampd.session_id": request.session_id, "ampd.round": request.round,
                            "ampd.tool.name": name, "ampd.sidecar": self.name}, kind="server", error=error)
        if error:  # a failed call is a result the model reads: its session goes on
            self.failures += 1
            log.warning("tool failed", tool=name, session=request.session_id)
            return sidecar_pb2.ToolCallResult(content=f"error: {error}", error=error, started=started,
                                              finished=time.time())
        return sidecar_pb2.ToolCallResult(result_tokens=out.result_tokens, content=out.content,
                                          started=started, finished=time.time())

    async def ListTools(self, request, context) -> sidecar_pb2.ListToolsReply:
        return sidecar_pb2.ListToolsReply(names=self.registry.names())

    async def Metrics(self, request, context) -> common_pb2.MetricsReply:
        stopped = self.procs.stopped if self.procs is not None else 0
        return common_pb2.MetricsReply(worker_id=self.name,
                                       values={"calls": self.calls, "failures": self.failures, "stopped": stopped})


async def amain(args: argparse.Namespace) -> None:
    logs.configure(f"sidecar:{args.name}")
    grpcserver.set_tokens(args.auth_token, args.internal_token)
    registry = ToolRegistry()
    for spec in args.tool:
        registry.load(spec)
    limits = ToolLimits(cpu_s=args.tool_cpu_s, wall_s=args.tool_wall_s, memory_mb=args.tool_memory_mb)
    procs = ToolProcesses(registry.specs, limits, args.tool_workers) if registry.specs else None
    if procs is not None:
        try:
            await procs.start()
        except StartError as exc:
            sys.exit(f"ampd-sidecar: error: {exc}")
    service = SidecarService(registry, args.name, limits, procs)
    server, port, health = await grpcserver.start_server(
        f"{args.host}:{args.port}",
        lambda s: sidecar_pb2_grpc.add_ToolSidecarServicer_to_server(service, s),
        [sidecar_pb2.DESCRIPTOR.services_by_name["ToolSidecar"].full_name],
    )
    metrics_port = metrics.serve(args.host, args.metrics_port, [metrics.rpc_collector(service, "sidecar")])
    write_ready_file(args.ready_file, port, metrics_port)
    log.info("sidecar serving", port=port, metrics_port=metrics_port, tools=registry.names(),
             tool_processes=args.tool_workers if procs else 0)
    await grpcserver.serve_until_signal(server, health, on_stop=procs.close if procs else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampd-sidecar", description="AMPD tool sidecar")
    add_flags(parser, SERVICE_SETTINGS["sidecar"], env=True)
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        parser = build_parser()
    except ConfigError as exc:
        sys.exit(f"ampd-sidecar: error: {exc}")
    args = parser.parse_args(argv)
    for spec in args.tool:  # fail fast with a clear message, before binding a port
        try:
            ToolRegistry().load(spec)
        except ValueError as exc:
            parser.error(f"--tool: {exc}")
    try:
        tracing.setup("sidecar", args.otlp_endpoint, instance=args.name)
    except ConfigError as exc:
        sys.exit(f"ampd-sidecar: error: {exc}")
    grpcserver.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
