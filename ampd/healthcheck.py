"""A container health check: `python -m ampd.healthcheck HOST:PORT` (or `--http URL`).

gRPC: one grpc.health.v1 `Check` of the overall status (service ""), which every AMPD server sets
SERVING once it accepts calls (ampd/grpcserver.py). HTTP: one GET that must answer 200. Exit status
0 means healthy, 1 unhealthy (the reason goes to stderr, which `docker inspect` shows), so
docker-compose.yml's healthchecks are one short command line every compose engine runs the same
way (podman-compose 1.0.3 mangles a `CMD` list with more than one argument; a `CMD-SHELL` string it
passes through).
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check_grpc(target: str, timeout_s: float) -> str:
    """'' when the server at ``target`` reports SERVING, else why not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{target}: {exc.code().name} {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return ""


def check_http(url: str, timeout_s: float) -> str:
    """'' when GET ``url`` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return "" if resp.status == 200 else f"{url}: HTTP {resp.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ampd.healthcheck", description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("target", nargs="?", help="gRPC server HOST:PORT")
    what.add_argument("--http", metavar="URL", help="HTTP URL that must answer 200")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    why = check_http(args.http, args.timeout) if args.http else check_grpc(args.target, args.timeout)
    if why:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
