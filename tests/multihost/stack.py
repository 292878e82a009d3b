"""AMPD's services on the two hosts of tests/multihost/hosts.py: Redis and the coordinator on host 1,
the prefill and decode workers (each decode worker with its sidecar) spread over both, every one
bound to its host's address. KV moves over NIXL with UCX over TCP (UCX_TLS=tcp,self): each worker's
UCX listens on its host's interface only (ampd.kv.transport.bind_ucx_to), so KV between hosts
crosses the veth link.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ampd import deathsig
from ampd.config import SECRET_SETTINGS, SERVICE_SETTINGS, Config, env_name, to_argv
from ampd.grpcserver import read_ready_file
from tests.multihost.hosts import Hosts

REPO = Path(__file__).resolve().parents[2]
REDIS_PORT = 6379
COORDINATOR_PORT = 50051
# (name, service, host index, port, placement): host 1 (index 0) holds Redis, the coordinator,
# decode-0 and prefill-1; host 2 decode-1 and prefill-0. The coordinator breaks ties among idle
# workers by id: an idle deployment's first choice, prefill-0 for decode-0, crosses hosts.
LAYOUT = (
    ("sidecar-0", "sidecar", 0, 50081, {"name": "sidecar-0"}),
    ("sidecar-1", "sidecar", 1, 50082, {"name": "sidecar-1"}),
    ("decode-0", "decode", 0, 50061, {"worker_id": "decode-0", "sidecar": "@sidecar-0"}),
    ("decode-1", "decode", 1, 50062, {"worker_id": "decode-1", "sidecar": "@sidecar-1"}),
    ("prefill-0", "prefill", 1, 50071, {"worker_id": "prefill-0"}),
    ("prefill-1", "prefill", 0, 50072, {"worker_id": "prefill-1"}),
    ("coordinator", "coordinator", 0, COORDINATOR_PORT, {}),
)


class StackError(RuntimeError):
    pass


class Stack:
    """``with Stack(hosts, cfg, run_dir) as st``: st.coordinator, st.workers {id: (kind, addr)},
    st.host_of {name: host index}; stops every process it started on exit."""

    def __init__(self, hosts: Hosts, cfg: Config, run_dir: Path, ready_timeout_s: float = 120.0) -> None:
        self.hosts, self.cfg, self.dir = hosts, cfg, Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.addr: dict[str, str] = {}
        self.host_of = {name: host for name, _, host, _, _ in LAYOUT}
        self.host_of["redis"] = 0
        self.redis_url = f"redis://{hosts.addr[0]}:{REDIS_PORT}/0"
        self.coordinator = f"{hosts.addr[0]}:{COORDINATOR_PORT}"
        self.workers = {name: (svc, f"{hosts.addr[h]}:{port}") for name, svc, h, port, _ in LAYOUT
                        if svc in ("prefill", "decode")}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AMPD_") and not k.startswith("UCX_")}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", NIXL_LOG_LEVEL="WARN", UCX_TLS="tcp,self")
        for setting in SECRET_SETTINGS:  # secrets through the environment, as `ampd up` passes them
            value = self.cfg.with_(redis_url=self.redis_url).get(setting)
            if value:
                env[env_name(setting)] = str(value)
        return env

    def _spawn(self, name: str, host: int, argv: list[str]) -> None:
        with open(self.dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(deathsig.wrap(self.hosts.wrap(host, argv)), stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
                                                cwd=REPO, start_new_session=True)

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise StackError("redis-server not found")
        self._spawn("redis", 0, [exe, "--port", str(REDIS_PORT), "--bind", self.hosts.addr[0], "--save", "",
                                 "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no"])
        groups = [[x for x in LAYOUT if x[1] == "sidecar"], [x for x in LAYOUT if x[1] in ("decode", "prefill")],
                  [x for x in LAYOUT if x[1] == "coordinator"]]
        for group in groups:  # sidecars before their decode workers, workers before the coordinator
            for name, svc, host, port, placement in group:
                place = {k: (f"{self.hosts.addr[self.host_of[v[1:]]]}:{self._port(v[1:])}" if str(v).startswith("@")
                             else v) for k, v in placement.items()}
                cfg = self.cfg.with_(host=self.hosts.addr[host], port=port, **place)
                names = [n for n in SERVICE_SETTINGS[svc] if n not in ("ready_file", *SECRET_SETTINGS)]
                argv = [sys.executable, "-m", f"services.{svc}", *to_argv(cfg, names),
                        "--ready-file", str(self.dir / f"{name}.ready")]
                self._spawn(name, host, argv)
            self._wait_ready([g[0] for g in group])

    @staticmethod
    def _port(name: str) -> int:
        return next(port for n, _, _, port, _ in LAYOUT if n == name)

    def _wait_ready(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                proc = self.procs[name]
                if proc.poll() is not None:
                    tail = (self.dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise StackError(f"{name} exited with status {proc.returncode}; its log:\n{tail}")
                ready = self.dir / f"{name}.ready"
                if ready.exists() and read_ready_file(ready).get("port"):
                    pending.discard(name)
            if time.monotonic() > deadline:
                raise StackError(f"timed out waiting for {', '.join(sorted(pending))} (logs in {self.dir})")
            time.sleep(0.1)

    def drive(self, spec: dict, host: int = 0, timeout_s: float = 300.0) -> dict:
        """Runs tests/multihost/drive.py on host ``host`` with ``spec`` (its coordinator and workers
        filled in); its result."""
        spec = {"coordinator": self.coordinator, "workers": self.workers, **spec}
        return run_driver(spec, self.dir, self.env(), wrap=lambda argv: self.hosts.wrap(host, argv),
                          timeout_s=timeout_s)

    def stop(self) -> None:
        """SIGTERM to every process (the coordinator first, Redis last), SIGKILL after a bound."""
        order = ["coordinator", *[n for n, *_ in reversed(LAYOUT) if n != "coordinator"], "redis"]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()


def run_driver(spec: dict, workdir: Path, env: dict[str, str], wrap=lambda argv: argv,
               timeout_s: float = 300.0) -> dict:
    """tests/multihost/drive.py with ``spec``, in a process of its own; its JSON result."""
    n = len(list(Path(workdir).glob("drive-*.json")))
    spec_file, out_file = Path(workdir) / f"drive-{n}.json", Path(workdir) / f"drive-{n}.out.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run(wrap([sys.executable, "-m", "tests.multihost.drive", str(spec_file), str(out_file)]),
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise StackError(f"the driver failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(out_file.read_text())
