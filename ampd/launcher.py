"""`ampd up` and `ampd demo`: a whole local deployment as processes on 127.0.0.1.

Redis (a private redis-server on a free port unless --redis-url is given), the coordinator, prefill
workers, decode workers each with its tool sidecar. Every child gets each of its settings as a flag
(ampd.config.to_argv), so what the launcher starts does not depend on AMPD_* variables in the
caller's environment.

Supervision: a child that dies is started again (same id, same ports; a worker whose old port is
taken gets a free one, which it registers), after a back-off that grows while it keeps dying; the
others keep serving. Only Ctrl-C or SIGTERM stops everything. Each child runs in its own process
group (a Ctrl-C at the terminal reaches the launcher only, which stops the children in order) and
gets SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG, through ampd.deathsig); a service that does
not finish stopping within seconds exits anyway (ampd.grpcserver), so none is orphaned.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ampd.cli import CliError
from ampd import deathsig, grpcserver, tracing
from ampd.config import (SECRET_SETTINGS, SERVICE_SETTINGS, SETTINGS, UP_SETTINGS, Config, ConfigError, add_flags,
                         config_from_args, env_name, to_argv)
from ampd.deployment import expand_spec, format_spec, worker_shape
from ampd.state.local import RedisStartError, start_redis
from ampd.state.url import parse as parse_redis_url
from ampd.trust import new_secret, redacted

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
    argv: Callable[[int], list[str]] | None = None  # its command line, given the port to bind
    port: int = 0  # the port it bound (0: not known yet)
    keep_port: bool = False  # peers dial a fixed address (sidecar, coordinator, Redis): never move it
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float = 0.0  # when a dead child is started again (0: not scheduled)


RESTART_BACKOFF_S = (0.2, 1.0, 2.0, 5.0, 10.0)  # the wait before restart n (the last repeats)
STABLE_AFTER_S = 30.0  # a child up this long has its back-off reset

class Deployment:
    """Starts and stops one local deployment. Use as a context manager."""

    def __init__(self, cfg: Config, supervise: bool = True, ready_timeout_s: float | None = None,
                 frontend: bool = False) -> None:
        from ampd.engine import check_available, engine_spec

        try:
            cfg.validate()
            if cfg.deployment.redis_url:  # a malformed one fails here, not in every child
                parse_redis_url(cfg.deployment.redis_url)
            check_available(cfg.deployment.engine, cfg.deployment.model)
            tracing.check_endpoint(cfg.deployment.otlp_endpoint)  # before any child fails on it
        except (ConfigError, ValueError) as exc:
            raise CliError(str(exc)) from None
        # Internal calls are authenticated even when the client API is open: the deployment's
        # secret, made here unless given. This process holds it too (its in-process clients, a test's,
        # call the workers); one it already holds is reused, so deployments started from one process
        # share it.
        self.internal_token = cfg.deployment.internal_token or grpcserver.internal_token() or new_secret()
        if not grpcserver.internal_token():
            grpcserver.set_internal_token(self.internal_token)
        self.cfg = cfg = cfg.with_(internal_token=self.internal_token)
        # per group of children: a real model loads for a while, an SGLang instance starts in ~1 min
        # on 2 busy cores (two of them at once take twice that)
        self.ready_timeout_s = ready_timeout_s or engine_spec(cfg.deployment.engine).ready_timeout_s
        self.supervise = supervise
        self.events: list[str] = []  # what supervision did, in order ("decode-0 exited with -9; restarted")
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._lock = threading.Lock()
        self.children: list[Child] = []
        self.redis_url = cfg.deployment.redis_url
        self.coordinator = ""  # the coordinators' addresses, comma-separated (what clients are given)
        self.coordinators: list[str] = []
        self.start_frontend = frontend
        self.frontend = ""  # the OpenAI-compatible front's URL (http://HOST:PORT), when started
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
    def _spawn(self, name: str, argv: Callable[[int], list[str]], keep_port: bool = False) -> Child:
        child = Child(name, None, self.run_dir / f"{name}.log", self.run_dir / f"{name}.port", argv,
                      keep_port=keep_port)
        self._launch(child)
        self.children.append(child)
        return child

    def _launch(self, child: Child) -> None:
        child.ready.unlink(missing_ok=True)
        args = [*child.argv(child.port), "--ready-file", str(child.ready)]
        env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"), PYTHONUNBUFFERED="1")
        for setting in SETTINGS:  # every setting is on the child's command line; none comes from here
            env.pop(env_name(setting), None)
        secrets = self.cfg.with_(redis_url=self.redis_url)
        for setting in SECRET_SETTINGS:  # but secrets: a command line shows in `ps`
            if secrets.get(setting):
                env[env_name(setting)] = str(secrets.get(setting))
        with open(child.log, "ab") as out:
            child.proc = subprocess.Popen(deathsig.wrap(args), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        child.started_at = time.monotonic()

    def _wait_ready(self, children: list[Child]) -> dict[str, int]:
        """The gRPC port of each of ``children`` once it serves (its /metrics URL goes to self.metrics)."""
        from ampd.grpcserver import read_ready_file  # grpc loads only when a deployment starts

        deadline = time.monotonic() + self.ready_timeout_s
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
                    ports[c.name] = c.port = ready["port"]
                    if ready.get("metrics_port"):
                        self.metrics[c.name] = f"http://{self.cfg.process.host}:{ready['metrics_port']}/metrics"
            if time.monotonic() > deadline:
                missing = [c.name for c in children if c.name not in ports]
                raise CliError(f"timed out waiting for {', '.join(missing)} (logs in {self.run_dir})")
            time.sleep(0.05)
        return ports

    def _start_redis(self, port: int = 0) -> subprocess.Popen:
        log = self.run_dir / "redis.log"
        try:
            proc, url = start_redis(self.run_dir, log=log, wrap=deathsig.wrap, port=port, new_session=True)
        except RedisStartError as exc:
            raise CliError(str(exc)) from None
        if not port:
            self.redis_url = url
            self.children.append(Child("redis", proc, log, None, port=int(url.rsplit(":", 1)[1].split("/")[0]),
                                       keep_port=True))
        return proc

    def _argv(self, service: str, **placement) -> Callable[[int], list[str]]:
        """`python -m services.<service>` with every setting it reads as a flag (but --ready-file),
        given the port to bind."""
        names = [n for n in SERVICE_SETTINGS[service] if n != "ready_file" and n not in SECRET_SETTINGS]

        def argv(port: int) -> list[str]:
            cfg = self.cfg.with_(redis_url=self.redis_url, **placement, port=port)
            return [sys.executable, "-m", f"services.{service}", *to_argv(cfg, names)]
        return argv

    def start(self) -> "Deployment":
        host = self.cfg.process.host
        if not self.redis_url:
            self._start_redis()
        sidecars = [self._spawn(f"sidecar-{i}", self._argv("sidecar", name=f"sidecar-{i}"), keep_port=True)
                    for i in range(len(self.decode_tps))]
        sidecar_ports = self._wait_ready(sidecars)
        workers = []
        threads = self.worker_threads()
        for i, tp in enumerate(self.decode_tps):
            workers.append(self._spawn(f"decode-{i}", self._argv(
                "decode", worker_id=f"decode-{i}", tp=tp, worker_threads=threads,
                sidecar=f"{host}:{sidecar_ports[f'sidecar-{i}']}")))
        for i, tp in enumerate(self.prefill_tps):
            workers.append(self._spawn(f"prefill-{i}", self._argv("prefill", worker_id=f"prefill-{i}", tp=tp,
                                                                  worker_threads=threads)))
        self._wait_ready(workers)
        # --port binds the (first) coordinator's port; each keeps its port across restarts (clients
        # hold its address). Several share the Redis; clients and the front get them all ("A,B").
        n = self.cfg.deployment.coordinators
        names = ["coordinator"] if n == 1 else [f"coordinator-{i}" for i in range(n)]
        coords = []
        for i, name in enumerate(names):
            coord_argv, coord_port = self._argv("coordinator"), self.cfg.process.port if i == 0 else 0
            coords.append(self._spawn(name, lambda port, a=coord_argv, p=coord_port: a(port or p), keep_port=True))
        ports = self._wait_ready(coords)
        self.coordinators = [f"{host}:{ports[name]}" for name in names]
        self.coordinator = ",".join(self.coordinators)
        if self.start_frontend:
            # --api-port binds the front's HTTP port; it keeps the port across restarts (clients hold its URL)
            argv, api_port = self._argv("frontend", coordinator_address=self.coordinator), self.cfg.frontend.api_port
            front = self._spawn("frontend", lambda port: argv(port or api_port), keep_port=True)
            self.frontend = f"http://{host}:{self._wait_ready([front])['frontend']}"
        if self.supervise:
            self._supervisor = threading.Thread(target=self._supervise_loop, name="ampd-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def worker_threads(self) -> int:
        """--worker-threads, or (0) the cores split among the engine workers: torch's default of one
        thread per core in each would oversubscribe the cores, and OpenMP threads that wait on a
        descheduled peer stall every step."""
        return self.cfg.worker.worker_threads or max(
            1, (os.cpu_count() or 1) // max(1, len(self.decode_tps) + len(self.prefill_tps)))

    # ---------------------------------------------------------------------------- supervision
    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def wait_serving(self, timeout_s: float = 90.0) -> None:
        """Until every child runs and serves (a restarted one has written its ready file again)."""
        deadline = time.monotonic() + timeout_s
        while not all(c.proc.poll() is None and not c.restart_at and (c.ready is None or c.ready.exists())
                      for c in self.children):
            if time.monotonic() > deadline:
                raise CliError(f"not every child serves after {timeout_s:g} s: {self.events[-3:]}")
            time.sleep(0.1)

    def _supervise_loop(self) -> None:
        while not self._stopping.wait(0.1):
            with self._lock:
                if not self._stopping.is_set():
                    try:
                        self.supervise_once(time.monotonic())
                    except Exception as exc:  # noqa: BLE001 - the supervisor must outlive any one failure
                        self._note(f"supervision error: {exc!r}")

    def supervise_once(self, now: float) -> None:
        """Restarts every child that died (once its back-off has passed) and notes its new port."""
        for c in self.children:
            if c.proc.poll() is None:
                if c.ready is not None and c.restarts and c.ready.exists() and not c.port:
                    c.port = read_port(c.ready)
                continue
            if not c.restart_at:
                up_s = now - c.started_at
                if up_s > STABLE_AFTER_S:
                    c.restarts = 0
                delay = RESTART_BACKOFF_S[min(c.restarts, len(RESTART_BACKOFF_S) - 1)]
                c.restart_at = now + delay
                if not c.keep_port and up_s < 5.0 and not (c.ready and c.ready.exists()):
                    c.port = 0  # it died before serving: perhaps its old port is taken
                self._note(f"{c.name} exited with status {c.proc.returncode}; restarting in {delay:g} s "
                           f"(log {c.log})")
                continue
            if now < c.restart_at:
                continue
            c.restart_at = 0.0
            c.restarts += 1
            try:
                if c.name == "redis":
                    c.proc = self._start_redis(port=c.port)
                    c.started_at = time.monotonic()
                else:
                    self._launch(c)
                    if not c.keep_port:
                        c.port = 0  # read from its ready file once it serves
            except (CliError, OSError) as exc:
                self._note(f"{c.name}: restart failed: {exc}")
                c.started_at = time.monotonic()
                continue
            self._note(f"{c.name} restarted (restart {c.restarts})")

    def _note(self, event: str) -> None:
        self.events.append(event)
        print(f"supervisor: {event}", file=sys.stderr, flush=True)

    # ----------------------------------------------------------------------------------- stop
    def stop(self, grace_s: float = 8.0) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
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
                f"redis {redacted(self.redis_url) or 'private (started here)'}, logs {self.run_dir}")


def read_port(ready: Path) -> int:
    from ampd.grpcserver import read_ready_file

    try:
        return read_ready_file(ready)["port"]
    except (OSError, ValueError, KeyError):
        return 0


def plan_deployment(cfg: Config, trace: str, gpus: int | None) -> tuple[Config, str]:
    """``cfg`` with the deployment the planner chooses for ``trace`` on ``gpus`` GPUs (default: as many
    as ``--prefill`` and ``--decode`` hold), under cfg's profile, policy and SLOs, and a line that says
    what it chose. A co-located winner runs under the policy the planner simulated it with (a
    co-located one): AMPD becomes co-location where that wins (docs/planner.md)."""
    from ampd.planner import PlanError, PlanRequest, plan
    from ampd.planner.cli import load_inputs
    from ampd.slo import SLO

    d, pol = cfg.deployment, cfg.policy
    if gpus is None:
        try:
            shape = worker_shape(pol.policy, d.prefill, d.decode)
            gpus = sum(tp * n for tp, n in (*shape.prefill, *shape.decode))
        except ValueError as exc:  # SpecError, an unknown policy
            raise CliError(str(exc)) from None
    profile, sessions = load_inputs(d.profile, trace)
    try:
        req = PlanRequest(profile, sessions, gpus, SLO(ttft_s=pol.ttft_slo, itl_s=pol.itl_slo), top=1,
                          policy=pol.policy)
        best = plan(req).top[0]
    except PlanError as exc:
        raise CliError(f"--{exc.field.replace('_', '-')}: {str(exc).partition(': ')[2]}") from None
    dep = best.deployment
    chosen = cfg.with_(prefill=dep.prefill_spec, decode=dep.decode_spec, policy=best.policy)
    line = (f"plan: prefill {dep.prefill_spec} decode {dep.decode_spec} policy {best.policy}, {dep.gpus} of "
            f"{gpus} GPUs (simulated SLO attainment {best.slo_attainment * 100:.1f}% on {len(sessions)} sessions "
            f"of {trace}, TTFT SLO {pol.ttft_slo:g} s, ITL SLO {pol.itl_slo:g} s)")
    return chosen, line


def cmd_up(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.plan:
        if not args.trace:
            raise CliError("--plan: give the workload to plan for with --trace F")
        cfg, line = plan_deployment(cfg, args.trace, args.gpus)
        print(line, flush=True)
    elif args.trace or args.gpus is not None:
        raise CliError(f"{'--trace' if args.trace else '--gpus'}: only with --plan")
    dep = Deployment(cfg, frontend=True)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting: {dep.describe()}", file=sys.stderr, flush=True)
    try:
        dep.start()
        print(f"coordinator {dep.coordinator}", flush=True)
        print(f"frontend {dep.frontend}/v1 (OpenAI API)", flush=True)
        print(dep.metrics_line(), flush=True)
        print("serving; Ctrl-C stops everything (a child that dies is restarted)", file=sys.stderr, flush=True)
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        print("stopping", file=sys.stderr, flush=True)
        dep.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ampd.bench.client import run_bench_cli
    from ampd.workload import dump_trace, generate

    dep = Deployment(Config.of(prefill="tp2*2", decode="tp2*2", profile=args.profile, policy=args.policy,
                               ttft_slo=args.ttft_slo, itl_slo=args.itl_slo), frontend=True)
    trace = dep.run_dir / "demo-trace.jsonl"
    sessions = generate(args.preset, args.rate, args.duration, args.seed)
    dump_trace(sessions, trace)
    print(f"demo: {len(sessions)} {args.preset} sessions over {args.duration:.0f} s; {dep.describe()}",
          file=sys.stderr, flush=True)
    with dep:
        print(f"coordinator {dep.coordinator}", file=sys.stderr, flush=True)
        print(f"frontend {dep.frontend}/v1 (OpenAI API)", file=sys.stderr, flush=True)
        print(dep.metrics_line(), file=sys.stderr, flush=True)
        return run_bench_cli(dep.coordinator, str(trace), args.ttft_slo, args.itl_slo,
                             json_out=args.json or None, verify_tokens=True)


def register(sub) -> None:
    p = sub.add_parser("up", help="launch a local deployment (Redis, coordinator, workers, sidecars, the "
                                  "OpenAI-compatible front)",
                       description="Starts Redis (unless --redis-url), the coordinator, the prefill and decode "
                                   "workers, one tool sidecar per decode worker and the OpenAI-compatible front "
                                   "(docs/frontend.md) on this machine. A co-located "
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
