"""`ampd up` and `ampd demo`: a whole local deployment as processes on 127.0.0.1.

Redis (a private redis-server on a free port unless --redis-url is given), the coordinator, prefill
workers, decode workers each with its tool sidecar. Every child gets each of its settings as a flag
(ampd.config.to_argv), so what the launcher starts does not depend on AMPD_* variables in the
caller's environment. Ctrl-C or SIGTERM stops everything; children also get SIGTERM from the kernel
if the launcher itself dies (PR_SET_PDEATHSIG), so none is orphaned.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ampd.cli import CliError
from ampd.config import (SECRET_SETTINGS, SERVICE_SETTINGS, SETTINGS, UP_SETTINGS, Config, ConfigError, add_flags,
                         config_from_args, env_name, to_argv)
from ampd.deployment import expand_spec, format_spec, worker_shape
from ampd.state.local import RedisStartError, start_redis

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def Options(**settings) -> Config:
    """A launch configuration from settings by name (``Options(policy="remote", decode="tp2*2")``);
    the names and defaults are ampd.config's."""
    return Config.of(**settings)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    ready: Path | None


class Deployment:
    """Starts and stops one local deployment. Use as a context manager."""

    def __init__(self, cfg: Config) -> None:
        try:
            cfg.validate()
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        self.cfg = cfg
        self.children: list[Child] = []
        self.redis_url = cfg.deployment.redis_url
        self.coordinator = ""
        self.metrics: dict[str, str] = {}  # child name -> its /metrics URL
        self.run_dir = Path(cfg.deployment.run_dir or tempfile.mkdtemp(prefix="ampd-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.shape = self._shape()
        self.prefill_tps = expand_spec(self.shape.prefill)
        self.decode_tps = expand_spec(self.shape.decode)

    def _shape(self):
        from ampd.perf import load_profile

        d = self.cfg.deployment
        try:
            profile = load_profile(d.profile)
            return worker_shape(self.cfg.policy.policy, d.prefill, d.decode, profile.tps)
        except ValueError as exc:  # SpecError, an unknown policy or profile
            raise CliError(str(exc)) from None

    # ---------------------------------------------------------------------------------- start
    def _spawn(self, name: str, args: list[str], ready: bool = True) -> Child:
        log = self.run_dir / f"{name}.log"
        ready_file = self.run_dir / f"{name}.port" if ready else None
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
            args = [*args, "--ready-file", str(ready_file)]
        env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"), PYTHONUNBUFFERED="1")
        for setting in SETTINGS:  # every setting is on the child's command line; none comes from here
            env.pop(env_name(setting), None)
        for setting in SECRET_SETTINGS:  # but secrets: a command line shows in `ps`
            if self.cfg.get(setting):
                env[env_name(setting)] = str(self.cfg.get(setting))
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, preexec_fn=_die_with_parent)
        child = Child(name, proc, log, ready_file)
        self.children.append(child)
        return child

    def _wait_ready(self, children: list[Child], timeout_s: float = 90.0) -> dict[str, int]:
        """The gRPC port of each of ``children`` once it serves (its /metrics URL goes to self.metrics)."""
        from ampd.grpcserver import read_ready_file  # grpc loads only when a deployment starts

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
                    ready = read_ready_file(c.ready)
                    ports[c.name] = ready["port"]
                    if ready.get("metrics_port"):
                        self.metrics[c.name] = f"http://{self.cfg.process.host}:{ready['metrics_port']}/metrics"
            if time.monotonic() > deadline:
                missing = [c.name for c in children if c.name not in ports]
                raise CliError(f"timed out waiting for {', '.join(missing)} (logs in {self.run_dir})")
            time.sleep(0.05)
        return ports

    def _start_redis(self) -> None:
        log = self.run_dir / "redis.log"
        try:
            proc, self.redis_url = start_redis(self.run_dir, log=log, preexec_fn=_die_with_parent)
        except RedisStartError as exc:
            raise CliError(str(exc)) from None
        self.children.append(Child("redis", proc, log, None))

    def _argv(self, service: str, **placement) -> list[str]:
        """`python -m services.<service>` with every setting it reads as a flag (but --ready-file)."""
        names = [n for n in SERVICE_SETTINGS[service] if n != "ready_file" and n not in SECRET_SETTINGS]
        cfg = self.cfg.with_(redis_url=self.redis_url, **placement)
        return [sys.executable, "-m", f"services.{service}", *to_argv(cfg, names)]

    def start(self) -> "Deployment":
        host = self.cfg.process.host
        if not self.redis_url:
            self._start_redis()
        sidecars = [self._spawn(f"sidecar-{i}", self._argv("sidecar", name=f"sidecar-{i}", port=0))
                    for i in range(len(self.decode_tps))]
        sidecar_ports = self._wait_ready(sidecars)
        workers = []
        for i, tp in enumerate(self.decode_tps):
            workers.append(self._spawn(f"decode-{i}", self._argv(
                "decode", worker_id=f"decode-{i}", tp=tp, port=0,
                sidecar=f"{host}:{sidecar_ports[f'sidecar-{i}']}")))
        for i, tp in enumerate(self.prefill_tps):
            workers.append(self._spawn(f"prefill-{i}", self._argv("prefill", worker_id=f"prefill-{i}", tp=tp,
                                                                   port=0)))
        self._wait_ready(workers)
        coord = self._spawn("coordinator", self._argv("coordinator"))
        self.coordinator = f"{host}:{self._wait_ready([coord])['coordinator']}"
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

    def metrics_line(self) -> str:
        """Every service's /metrics URL on one line (docs/metrics.md)."""
        return "metrics " + " ".join(f"{name}={url}" for name, url in self.metrics.items())

    def describe(self) -> str:
        c = self.cfg
        colocated = " (co-located: the prefill GPUs serve as co-located workers)" if self.shape.colocated else ""
        return (f"policy {c.policy.policy}, profile {c.deployment.profile}, engine {c.deployment.engine}, "
                f"prefill {format_spec(self.shape.prefill)}, decode {format_spec(self.shape.decode)}{colocated}, "
                f"redis {self.redis_url or 'private (started here)'}, logs {self.run_dir}")


def cmd_up(args: argparse.Namespace) -> int:
    dep = Deployment(config_from_args(args))
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting: {dep.describe()}", file=sys.stderr, flush=True)
    try:
        dep.start()
        print(f"coordinator {dep.coordinator}", flush=True)
        print(dep.metrics_line(), flush=True)
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

    dep = Deployment(Config.of(prefill="tp2*2", decode="tp2*2", profile=args.profile, policy=args.policy,
                               ttft_slo=args.ttft_slo, itl_slo=args.itl_slo))
    trace = dep.run_dir / "demo-trace.jsonl"
    sessions = generate(args.preset, args.rate, args.duration, args.seed)
    dump_trace(sessions, trace)
    print(f"demo: {len(sessions)} {args.preset} sessions over {args.duration:.0f} s; {dep.describe()}",
          file=sys.stderr, flush=True)
    with dep:
        print(f"coordinator {dep.coordinator}", file=sys.stderr, flush=True)
        print(dep.metrics_line(), file=sys.stderr, flush=True)
        return run_bench_cli(dep.coordinator, str(trace), args.ttft_slo, args.itl_slo,
                             json_out=args.json or None, verify_tokens=True)


def register(sub) -> None:
    p = sub.add_parser("up", help="launch a local deployment (Redis, coordinator, workers, sidecars)",
                       description="Starts Redis (unless --redis-url), the coordinator, the prefill and decode "
                                   "workers and one tool sidecar per decode worker on this machine. A co-located "
                                   "policy (colocated, continuum) runs no prefill workers: the --prefill GPUs "
                                   "become co-located workers, as in `ampd simulate`.")
    add_flags(p, UP_SETTINGS)
    p.set_defaults(func=cmd_up)
    d = sub.add_parser("demo", help="launch a deployment, replay a short trace, print the SLO report")
    d.add_argument("--preset", default="toolbench", help="workload preset of the demo trace")
    d.add_argument("--rate", type=float, default=1.0, help="sessions per second of the demo trace")
    d.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals in the demo trace")
    d.add_argument("--seed", type=int, default=1, help="seed of the demo trace")
    add_flags(d, ("profile", "policy", "ttft_slo", "itl_slo"))
    d.add_argument("--json", default="", help="write the report here")
    d.set_defaults(func=cmd_demo)
