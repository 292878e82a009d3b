"""`ampd bench`: replay a trace against a running deployment and report SLO attainment."""
from __future__ import annotations

import argparse

from ampd.cli import CliError
from ampd.config import add_flags


def _cmd(args: argparse.Namespace) -> int:
    from ampd import grpcserver
    from ampd.bench.client import run_bench_cli

    grpcserver.set_auth_token(args.auth_token)
    if args.api == "openai":
        if not args.target.startswith(("http://", "https://")):
            raise CliError(f"--target {args.target!r}: expected the front's URL (http://HOST:PORT) with --api openai")
        if args.verify_tokens or args.client_tools:
            raise CliError("--verify-tokens and --client-tools are for --api grpc (the front's tools are the "
                           "client's)")
    else:
        from ampd.coordinators import parse_addresses

        try:
            parse_addresses(args.target)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    return run_bench_cli(args.target, args.trace, args.ttft_slo, args.itl_slo, json_out=args.json or None,
                         verify_tokens=args.verify_tokens, client_tools=args.client_tools,
                         timeout_s=args.timeout, api=args.api, model=args.model, api_key=args.api_key)


def _sched(args: argparse.Namespace) -> int:
    import json

    from ampd.bench.sched import format_sched, run
    from ampd.state.local import RedisStartError

    try:
        r = run(args.redis_url, args.decisions)
    except RedisStartError as exc:
        raise CliError(str(exc)) from None
    print(format_sched(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def register(sub) -> None:
    s = sub.add_parser("bench-sched", help="routing and reordering decision latency")
    s.add_argument("--json", default="", help="write the results (docs/report.md keys) here")
    add_flags(s, ("redis_url",))
    s.add_argument("--decisions", type=int, default=3000)
    s.set_defaults(func=_sched)

    p = sub.add_parser("bench", help="replay a trace (over gRPC or the OpenAI API) and report SLO attainment")
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="grpc: one session stream per trace session at the coordinator; openai: streamed "
                        "/v1/completions through the front, the whole history resent every round, the client "
                        "waiting out each tool time (docs/frontend.md)")
    p.add_argument("--target", required=True,
                   help="coordinator HOST:PORT (grpc; several sharing one Redis: comma-separated, a session whose "
                        "coordinator is lost goes on through another) or the front's URL (openai)")
    p.add_argument("--model", default="", help="--api openai: the model to ask for (default: the front's first)")
    p.add_argument("--api-key", default="", help="--api openai: the front's key (its --auth-token), if it has one")
    add_flags(p, ("trace",), required=("trace",))
    add_flags(p, ("ttft_slo", "itl_slo"), required=("ttft_slo", "itl_slo"))
    p.add_argument("--json", default="", help="write the report (docs/report.md keys) here")
    p.add_argument("--verify-tokens", action="store_true",
                   help="check every token against the mock engine's deterministic output")
    p.add_argument("--client-tools", action="store_true",
                   help="run tool calls in the client instead of the sidecars")
    p.add_argument("--timeout", type=float, default=600.0, help="per-session deadline, seconds")
    add_flags(p, ("auth_token",), env=True)
    p.set_defaults(func=_cmd)
