"""`ampd up` and `ampd demo`: a whole local deployment as processes on 127.0.0.1.

Redis (a local redis-server on a free port unless --redis-url is given), the coordinator, prefill
workers, decode workers each with its tool sidecar. Ctrl-C or SIGTERM stops everything; children
also get SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so none is orphaned.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ampd.cli import CliError

DEFAULT_PROFILE = "qwen3-32b@h20"
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def redis_command(port: int, workdir: Path) -> list[str]:
    """A private, memory-only redis-server on loopback."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise CliError("redis-server not found: install it (apt-get install redis-server) or pass --redis-url")
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]


def wait_for_redis(url: str, proc: subprocess.Popen, log: Path | None = None, timeout_s: float = 15.0) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise CliError(f"redis-server did not start (log: {log})")
            time.sleep(0.05)


@dataclass
class Options:
    prefill: str = "tp1*1"
    decode: str = "tp1*1"
    profile: str = DEFAULT_PROFILE
    policy: str = "ampd"
    engine: str = "mock"
    redis_url: str = ""
    ttft_slo: float = 2.0
    itl_slo: float = 0.1
    host: str = "127.0.0.1"
    port: int = 0
    namespace: str = "ampd"
    window: float = 10.0
    reorder_window: int = 3
    seed: int = 0
    slack: str = ""  # Algorithm 1 slack rule; "" = the policy's default
    chunked_prefill: bool = False  # decode workers chunk local prefills (beyond the paper)
    kv_admission: str = "wait"  # a decode round whose KV does not fit: "wait" for KV, or "fail" the session
    kv_overlap: bool = True  # prefill workers read the next task's history KV during the current compute
    tools: list[str] = field(default_factory=list)
    run_dir: str = ""
    extra_worker_args: list[str] = field(default_factory=list)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    ready: Path | None


class Deployment:
    """Starts and stops one local deployment. Use as a context manager."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.children: list[Child] = []
        self.redis_url = opts.redis_url
        self.coordinator = ""
        self.run_dir = Path(opts.run_dir or tempfile.mkdtemp(prefix="ampd-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.prefill_tps, self.decode_tps = self._shape()

    def _shape(self) -> tuple[list[int], list[int]]:
        from ampd.perf import load_profile
        from ampd.policy import policy_spec
        from ampd.sim.spec import SpecError, expand_spec, parse_spec

        try:
            prefill = expand_spec(parse_spec(_spec(self.opts.prefill)))
            decode = expand_spec(parse_spec(_spec(self.opts.decode)))
            spec = policy_spec(self.opts.policy)
            profile = load_profile(self.opts.profile)
        except (SpecError, ValueError) as exc:
            raise CliError(str(exc)) from exc
        for tp in prefill + decode:
            if tp not in profile.tps:
                raise CliError(f"profile {profile.name} has no TP {tp} (has {list(profile.tps)})")
        if not spec.uses_prefill_workers:
            # Co-located baselines: the prefill GPUs serve as co-located workers too (same GPU count).
            decode, prefill = decode + prefill, []
        if not decode:
            raise CliError("a deployment needs at least one decode worker (--decode)")
        return prefill, decode

    # ---------------------------------------------------------------------------------- start
    def _spawn(self, name: str, args: list[str], ready: bool = True) -> Child:
        log = self.run_dir / f"{name}.log"
        ready_file = self.run_dir / f"{name}.port" if ready else None
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
            args = [*args, "--ready-file", str(ready_file)]
        env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"), PYTHONUNBUFFERED="1")
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, preexec_fn=_die_with_parent)
        child = Child(name, proc, log, ready_file)
        self.children.append(child)
        return child

    def _wait_ready(self, children: list[Child], timeout_s: float = 90.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        ports: dict[str, int] = {}
        while len(ports) < len(children):
            for c in children:
                if c.name in ports:
                    continue
                if c.proc.poll() is not None:
                    tail = c.log.read_text(errors="replace")[-2000:]
                    raise CliError(f"{c.name} exited with status {c.proc.returncode}; its log ({c.log}):\n{tail}")
                if c.ready and c.ready.exists():
                    ports[c.name] = int(c.ready.read_text())
            if time.monotonic() > deadline:
                missing = [c.name for c in children if c.name not in ports]
                raise CliError(f"timed out waiting for {', '.join(missing)} (logs in {self.run_dir})")
            time.sleep(0.05)
        return ports

    def _start_redis(self) -> None:
        port = free_port()
        self._spawn("redis", redis_command(port, self.run_dir), ready=False)
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        wait_for_redis(self.redis_url, self.children[-1].proc, self.children[-1].log)

    def start(self) -> "Deployment":
        o = self.opts
        py = sys.executable
        if not self.redis_url:
            self._start_redis()
        common = ["--redis-url", self.redis_url, "--namespace", o.namespace, "--profile", o.profile,
                  "--policy", o.policy, "--ttft-slo", str(o.ttft_slo), "--itl-slo", str(o.itl_slo),
                  "--host", o.host]
        worker = [*common, "--engine", o.engine, "--window", str(o.window),
                  "--reorder-window", str(o.reorder_window), *o.extra_worker_args]
        tool_args = [a for t in o.tools for a in ("--tool", t)]
        sidecars = [self._spawn(f"sidecar-{i}", [py, "-m", "services.sidecar", "--name", f"sidecar-{i}",
                                                 "--host", o.host, *tool_args])
                    for i in range(len(self.decode_tps))]
        sidecar_ports = self._wait_ready(sidecars)
        workers = []
        for i, tp in enumerate(self.decode_tps):
            workers.append(self._spawn(f"decode-{i}", [
                py, "-m", "services.decode", "--worker-id", f"decode-{i}", "--tp", str(tp), *worker,
                "--sidecar", f"{o.host}:{sidecar_ports[f'sidecar-{i}']}",
                *(["--chunked-prefill"] if o.chunked_prefill else []),
                *(["--kv-admission", o.kv_admission] if o.kv_admission != "wait" else [])]))
        for i, tp in enumerate(self.prefill_tps):
            workers.append(self._spawn(f"prefill-{i}", [
                py, "-m", "services.prefill", "--worker-id", f"prefill-{i}", "--tp", str(tp), *worker,
                *([] if o.kv_overlap else ["--no-kv-overlap"])]))
        self._wait_ready(workers)
        coord = self._spawn("coordinator", [py, "-m", "services.coordinator", *common, "--port", str(o.port),
                                             "--seed", str(o.seed), *(["--slack", o.slack] if o.slack else [])])
        self.coordinator = f"{o.host}:{self._wait_ready([coord])['coordinator']}"
        return self

    # ----------------------------------------------------------------------------------- stop
    def stop(self, grace_s: float = 8.0) -> None:
        # Coordinator first, workers next, Redis last: nothing talks to a stopped peer for long.
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        self.children.clear()

    def __enter__(self) -> "Deployment":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        from ampd.sim.spec import format_spec

        def groups(tps: list[int]) -> str:
            counts: dict[int, int] = {}
            for tp in tps:
                counts[tp] = counts.get(tp, 0) + 1
            return format_spec(tuple(counts.items()))

        return (f"policy {self.opts.policy}, profile {self.opts.profile}, engine {self.opts.engine}, "
                f"prefill {groups(self.prefill_tps)}, decode {groups(self.decode_tps)}, "
                f"redis {self.redis_url or 'private (started here)'}, logs {self.run_dir}")


def _spec(value: str) -> str:
    """`--prefill 2` means two workers of TP 1; a SPEC (`tp2*2`) is taken as is."""
    value = value.strip()
    if value.isdigit():
        return f"tp1*{value}" if int(value) > 0 else "none"
    return value


def options_from_args(args: argparse.Namespace) -> Options:
    if args.ttft_slo <= 0 or args.itl_slo <= 0:
        raise CliError("--ttft-slo and --itl-slo must be > 0")
    return Options(prefill=args.prefill, decode=args.decode, profile=args.profile, policy=args.policy,
                   engine=args.engine, redis_url=args.redis_url, ttft_slo=args.ttft_slo,
                   itl_slo=args.itl_slo, host=args.host, port=args.port, namespace=args.namespace,
                   window=args.window, reorder_window=args.reorder_window, seed=args.seed,
                   slack=args.slack, chunked_prefill=args.chunked_prefill, tools=list(args.tool),
                   run_dir=args.run_dir, kv_admission=args.kv_admission, kv_overlap=args.kv_overlap)


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", default="tp1*1", help="prefill workers: a count (TP 1) or SPEC like tp2*2")
    p.add_argument("--decode", default="tp1*1", help="decode workers: a count (TP 1) or SPEC like tp2*2")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="shipped profile name or path")
    p.add_argument("--policy", default="ampd")
    p.add_argument("--engine", default="mock", choices=["mock"])
    p.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.1, help="seconds")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0 = free)")
    p.add_argument("--namespace", default="ampd", help="Redis key prefix")
    p.add_argument("--window", type=float, default=10.0, help="statistics window, seconds")
    p.add_argument("--reorder-window", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the router's random visiting order")
    p.add_argument("--slack", default="", choices=["", "window", "queue"],
                   help="Algorithm 1 slack rule: 'window' is the paper's, 'queue' (ampd's default) also "
                        "checks the task's predicted TTFT")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="decode workers split local prefills into chunks interleaved with decode steps")
    p.add_argument("--kv-admission", default="wait", choices=["wait", "fail"],
                   help="a decode round whose KV does not fit: 'wait' until KV frees, or 'fail' its session")
    p.add_argument("--kv-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill workers read the next task's history KV while the current one computes")
    p.add_argument("--tool", action="append", default=[], help="sidecar tool NAME=module:function")
    p.add_argument("--run-dir", default="", help="where logs go (default: a new temp folder)")


def cmd_up(args: argparse.Namespace) -> int:
    dep = Deployment(options_from_args(args))
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting: {dep.describe()}", file=sys.stderr, flush=True)
    try:
        dep.start()
        print(f"coordinator {dep.coordinator}", flush=True)
        print("serving; Ctrl-C stops everything", file=sys.stderr, flush=True)
        while not stop["now"]:
            for c in dep.children:
                if c.proc.poll() is not None:
                    print(f"{c.name} exited with status {c.proc.returncode} (log {c.log}); stopping",
                          file=sys.stderr, flush=True)
                    stop["now"] = True
                    break
            time.sleep(0.2)
    finally:
        print("stopping", file=sys.stderr, flush=True)
        dep.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ampd.bench.client import run_bench_cli
    from ampd.workload import dump_trace, generate

    opts = Options(prefill="tp2*2", decode="tp2*2", profile=args.profile, policy=args.policy,
                   ttft_slo=args.ttft_slo, itl_slo=args.itl_slo)
    dep = Deployment(opts)
    trace = dep.run_dir / "demo-trace.jsonl"
    sessions = generate(args.preset, args.rate, args.duration, args.seed)
    dump_trace(sessions, trace)
    print(f"demo: {len(sessions)} {args.preset} sessions over {args.duration:.0f} s; {dep.describe()}",
          file=sys.stderr, flush=True)
    with dep:
        print(f"coordinator {dep.coordinator}", file=sys.stderr, flush=True)
        return run_bench_cli(dep.coordinator, str(trace), args.ttft_slo, args.itl_slo,
                             json_out=args.json or None, verify_tokens=True)


def register(sub) -> None:
    p = sub.add_parser("up", help="launch a local deployment (Redis, coordinator, workers, sidecars)")
    add_deployment_args(p)
    p.set_defaults(func=cmd_up)
    d = sub.add_parser("demo", help="launch a deployment, replay a short trace, print the SLO report")
    d.add_argument("--preset", default="toolbench")
    d.add_argument("--rate", type=float, default=1.0)
    d.add_argument("--duration", type=float, default=30.0)
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--profile", default=DEFAULT_PROFILE)
    d.add_argument("--policy", default="ampd")
    d.add_argument("--ttft-slo", type=float, default=2.0)
    d.add_argument("--itl-slo", type=float, default=0.1)
    d.add_argument("--json", default="")
    d.set_defaults(func=cmd_demo)
