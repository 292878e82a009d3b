"""`make test-compose`: docker-compose.yml for real, under podman and podman-compose, and a swap.

1. builds the images with podman: Redis (deploy/redis.Dockerfile) and the one AMPD image
   (Dockerfile), both FROM the local base tests/compose/setup.sh made (no registry here);
2. brings up Redis and every service built from the Dockerfile with podman-compose, tier by tier in
   depends_on order, each tier healthy (its compose healthcheck, run by `podman healthcheck run`)
   before the next starts (podman-compose 1.0.3 ignores `condition: service_healthy`, and podman
   runs healthchecks on a timer only under systemd);
3. replays a short trace with `ampd bench` through the published coordinator port: every session
   must complete;
4. rebuilds the image (a new revision, so a new image from the cached layers) and, while a second
   replay runs, replaces the decode-0 container with one from the fresh image: stop (SIGTERM, the
   compose stop_grace_period), remove, `podman-compose up -d --no-deps decode-0`, healthy. The
   sessions the swap hit are judged by tests/compose/verdict.py (recovered, failed with a clear
   error, hung, lost): none may hang or be lost silently, every other session completes, and every
   hit session recovers (on another decode worker), unless --allow-failed;
5. replays once more: every session completes, some of them on the new decode-0;
6. brings the stack down and removes its containers and network (images stay: the layer cache).

podman-compose runs the copy of docker-compose.yml that tests/compose/resolve.py writes
(interpolated: podman-compose 1.0.3 misreads `${NAME:-}`). Run as root:
`.venv/bin/python tests/compose/stack.py` (after tests/compose/setup.sh). Prometheus and Grafana are
left out: their images come from a registry.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from resolve import resolve  # noqa: E402  (sibling modules; tests/ is not a package)
from verdict import judge  # noqa: E402

COMPOSE = ROOT / "docker-compose.yml"
PROJECT = "ampd-compose-test"
IMAGE = "localhost/ampd:compose-test"
REDIS_IMAGE = "localhost/ampd-redis:7"
SWAPPED = "decode-0"
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Failed(Exception):
    pass


def run(args: list[str], *, env: dict | None = None, check: bool = True, quiet: bool = False,
        timeout: float = 2400) -> subprocess.CompletedProcess:
    if not quiet:
        log("$ " + shlex.join(args))
    p = subprocess.run(args, env=env, cwd=ROOT, text=True, capture_output=True, timeout=timeout)
    if check and p.returncode:
        raise Failed(f"{shlex.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p


# ------------------------------------------------------------------------------------------ images
def build_args() -> list[str]:
    """podman build flags that let pip reach its index from inside the build, as on the host: host
    network, the host's CA bundle and pip.conf, its PIP_* settings as build arguments (the Dockerfile
    declares them; they are not kept in the image) and a local PIP_FIND_LINKS folder."""
    out = ["--network", "host"]
    for path in ("/etc/ssl/certs", "/etc/pip.conf"):
        if os.path.exists(path):
            out += ["-v", f"{path}:{path}:ro"]
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
        if os.environ.get(var):
            out += ["--build-arg", f"{var}={os.environ[var]}"]
    links = os.environ.get("PIP_FIND_LINKS", "")
    if links.startswith("/") and os.path.isdir(links):
        out += ["-v", f"{links}:{links}:ro"]
    return out


def build_images(base: str, revision: str, args: dict, with_redis: bool = True) -> str:
    """Builds the AMPD image as IMAGE, with compose's build `args` (and Redis); returns the AMPD
    image's id."""
    if with_redis:
        run(["podman", "build", "-q", *build_args(), "-f", "deploy/redis.Dockerfile",
             "--build-arg", f"BASE_IMAGE={base}", "-t", REDIS_IMAGE, "deploy"])
    compose_args = [a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")]
    run(["podman", "build", "-q", *build_args(), *compose_args, "--build-arg", f"BASE_IMAGE={base}",
         "--build-arg", f"AMPD_REVISION={revision}", "-t", IMAGE, "."])
    return image_id(IMAGE)


def image_id(ref: str) -> str:
    return run(["podman", "image", "inspect", "--format", "{{.Id}}", ref], quiet=True).stdout.strip()


# ------------------------------------------------------------------------------------------- stack
def selected(services: dict) -> list[str]:
    """Redis and every service built from the one Dockerfile (the AMPD services, whatever their
    number); the rest (Prometheus, Grafana) need a registry."""
    return [n for n, s in services.items() if n == "redis" or "build" in s]


def tiers(services: dict, names: list[str]) -> list[list[str]]:
    """`names` in depends_on levels: each tier depends only on earlier tiers."""
    deps = {n: set(services[n].get("depends_on") or ()) & set(names) for n in names}
    out, done = [], set()
    while len(done) < len(names):
        tier = sorted(n for n in names if n not in done and deps[n] <= done)
        if not tier:
            raise Failed(f"depends_on cycle among {sorted(set(names) - done)}")
        out.append(tier)
        done |= set(tier)
    return out


class Stack:
    def __init__(self, services: dict, compose_file: Path):
        self.services = services
        self.file = compose_file

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return run(["podman-compose", "-p", PROJECT, "-f", str(self.file), *args], check=check, timeout=timeout)

    @staticmethod
    def container(service: str) -> str:
        return f"{PROJECT}_{service}_1"  # podman-compose 1.0.3's naming

    def state(self, service: str) -> dict:
        p = run(["podman", "inspect", self.container(service)], check=False, quiet=True)
        return json.loads(p.stdout)[0] if p.returncode == 0 else {}

    def up(self, names: list[str]) -> None:
        # --no-deps is accepted but ignored by podman-compose 1.0.3: it runs the dependencies again,
        # which fails on their names and starts the (running) containers: a no-op.
        self.compose("up", "-d", "--no-build", "--no-deps", *names)

    def wait_healthy(self, names: list[str], timeout_s: float = 180.0) -> None:
        t = time.monotonic()
        waiting = set(names)
        while waiting:
            for name in sorted(waiting):
                st = self.state(name).get("State", {})
                if st.get("Status") not in ("running", None):
                    raise Failed(f"{name} is {st.get('Status')} (exit {st.get('ExitCode')}):\n{self.logs(name)}")
                if run(["podman", "healthcheck", "run", self.container(name)], check=False,
                       quiet=True).returncode == 0:
                    waiting.discard(name)
            if waiting and time.monotonic() - t > timeout_s:
                raise Failed(f"not healthy after {timeout_s:.0f} s: {sorted(waiting)}\n" +
                             "\n".join(self.logs(n) for n in sorted(waiting)))
            if waiting:
                time.sleep(1.0)
        log(f"healthy: {' '.join(names)} ({time.monotonic() - t:.1f} s)")

    def logs(self, service: str, tail: int = 40) -> str:
        p = run(["podman", "logs", "--tail", str(tail), self.container(service)], check=False, quiet=True)
        return f"--- {service} (last {tail} lines)\n{p.stdout}{p.stderr}"

    def down(self) -> None:
        self.compose("down", check=False, timeout=300)
        run(["podman", "network", "rm", "-f", f"{PROJECT}_default"], check=False, quiet=True)

    def swap(self, service: str) -> tuple[float, float]:
        """Replaces `service`'s container with one from the current IMAGE, as an operator does with
        podman-compose 1.0.3 (which neither recreates a container whose image changed nor honours
        stop_grace_period): stop with the grace period, remove, up. Returns the window (start, end):
        from the stop to the new container being healthy."""
        grace = str(self.services[service].get("stop_grace_period", "10s")).rstrip("s")
        start = time.time()
        run(["podman", "stop", "-t", grace, self.container(service)])
        log(f"{service} stopped after {time.time() - start:.1f} s")
        run(["podman", "rm", self.container(service)])
        self.up([service])
        self.wait_healthy([service])
        return start, time.time()


# ------------------------------------------------------------------------------------------ replay
def write_trace(path: Path, sessions: int, spread_s: float, prefix: str) -> None:
    """Short tool-using sessions (4 rounds, 1 s tools, ~7 s each) arriving evenly over `spread_s`."""
    with open(path, "w") as f:
        for i in range(sessions):
            rounds = [{"input": 400 if r == 0 else 60, "output": 32, **({"tool_s": 1.0} if r < 3 else {})}
                      for r in range(4)]
            f.write(json.dumps({"id": f"{prefix}-{i:03d}", "arrival": round(i * spread_s / sessions, 3),
                                "rounds": rounds}) + "\n")


class Bench:
    """`ampd bench` in a subprocess: over gRPC at the coordinator's published `port`, or, given `url`,
    through the OpenAI front there (`--api openai`). ``started`` is set once its progress bar appears,
    which it draws right before the first arrival (the interpreter's start-up, seconds here, comes
    before that)."""

    def __init__(self, port: int, trace: Path, out: Path, deadline_s: float, *, url: str = ""):
        target = ["--api", "openai", "--target", url] if url else ["--target", f"127.0.0.1:{port}"]
        args = [sys.executable, "-m", "ampd", "bench", *target, "--trace", str(trace),
                "--ttft-slo", "5", "--itl-slo", "0.5", "--timeout", str(deadline_s), "--json", str(out)]
        log("$ " + shlex.join(args))
        self.out, self.deadline_s = out, deadline_s
        self.proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.started = threading.Event()
        self._text: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read1(4096):
            self._text.append(chunk.decode(errors="replace"))
            if "replay:" in chunk.decode(errors="replace"):
                self.started.set()
        self.started.set()

    def sessions(self) -> list[dict]:
        """Waits for it to end; the per-session list of its --json report (gRPC only)."""
        return self.report()["sessions"]

    def report(self) -> dict:
        """Waits for it to end; its --json report."""
        try:
            self.proc.wait(timeout=self.deadline_s + 120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise Failed(f"ampd bench did not return within {self.deadline_s + 120:.0f} s")
        self._reader.join(timeout=10)
        text = "".join(self._text).replace("\r", "\n")
        print("\n".join("    " + ln for ln in text.splitlines() if ln.strip() and "replay:" not in ln), flush=True)
        if self.proc.returncode:
            raise Failed(f"ampd bench exited {self.proc.returncode}")
        return json.loads(self.out.read_text())


def all_complete(sessions: list[dict], what: str) -> None:
    bad = [f"{s['id']} ({s['decode_worker'] or 'unbound'}): {s['error'] or 'incomplete'}"
           for s in sessions if not s["completed"]]
    if bad:
        raise Failed(f"{what}: {len(bad)} of {len(sessions)} sessions did not complete:\n  " + "\n  ".join(bad))
    per = {}
    for s in sessions:
        per[s["decode_worker"]] = per.get(s["decode_worker"], 0) + 1
    log(f"{what}: {len(sessions)} of {len(sessions)} completed (per decode worker: {per})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Worker-loss recovery is on main: by default every session the swap hits must recover.
    p.add_argument("--allow-failed", dest="require_complete", action="store_false",
                   default=os.environ.get("AMPD_COMPOSE_REQUIRE_COMPLETE", "1") not in ("0", "false", "no"),
                   help="let a session the swap hits end with a clear error instead of recovering "
                        "(also AMPD_COMPOSE_REQUIRE_COMPLETE=0)")
    p.add_argument("--sessions", type=int, default=16, help="sessions per replay (default 16)")
    p.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    args = p.parse_args(argv)
    if args.sessions < 4:
        p.error("--sessions must be >= 4")
    os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "tests/compose/containers.conf"))
    base = os.environ.get("AMPD_BASE_IMAGE", "localhost/debian-py:bookworm")
    # Every port compose publishes on the host (AMPD_*_PORT) gets a free one: this may be a shared box.
    ports = {name: str(free_port()) for name in sorted(set(re.findall(r"\$\{(AMPD_[A-Z_]*_PORT)\b",
                                                                       COMPOSE.read_text())))}
    port = int(ports["AMPD_COORDINATOR_PORT"])
    # the stack's internal secret, made here as `make compose-secret` would (docs/deploy.md)
    secret = os.environ.get("AMPD_INTERNAL_TOKEN") or secrets.token_urlsafe(32)
    doc = resolve(COMPOSE, dict(os.environ, AMPD_IMAGE=IMAGE, AMPD_REDIS_IMAGE=REDIS_IMAGE, **ports,
                                AMPD_INTERNAL_TOKEN=secret))
    services = doc["services"]
    names = selected(services)
    if SWAPPED not in names:
        raise SystemExit(f"docker-compose.yml has no {SWAPPED} service to swap")
    args_of = {str(services[n]["build"].get("args") or {}) for n in names if "build" in services[n]}
    if len(args_of) != 1:
        raise SystemExit("the services built from the Dockerfile disagree on their build args")
    compose_args = next(services[n]["build"].get("args") or {} for n in names if "build" in services[n])
    work = Path(tempfile.mkdtemp(prefix="ampd-compose-"))
    (work / "compose.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    stack = Stack(services, work / "compose.yml")
    timings: dict[str, float] = {}
    deadline = 90.0  # per-session client deadline: a session that reaches it hung
    failed = False
    try:
        t = time.monotonic()
        build_images(base, "a", compose_args)
        timings["build"] = time.monotonic() - t

        stack.down()  # leftovers of an interrupted run
        t = time.monotonic()
        for tier in tiers(services, names):
            stack.up(tier)
            stack.wait_healthy(tier)
        timings["up"] = time.monotonic() - t

        t = time.monotonic()
        write_trace(work / "warm.jsonl", args.sessions, 6.0, "warm")
        all_complete(Bench(port, work / "warm.jsonl", work / "warm.json", deadline).sessions(), "replay")
        timings["replay"] = time.monotonic() - t

        t = time.monotonic()
        revision = f"swap-{int(time.time())}"
        fresh = build_images(base, revision, compose_args, with_redis=False)
        old = stack.state(SWAPPED)
        if fresh == old["Image"]:
            raise Failed("the rebuilt image is the running one: the swap would swap nothing")
        timings["rebuild"] = time.monotonic() - t

        t = time.monotonic()
        write_trace(work / "swap.jsonl", args.sessions, 8.0, "swap")
        replay = Bench(port, work / "swap.jsonl", work / "swap.json", deadline)
        replay.started.wait(60)
        time.sleep(5.0)  # mid-replay: arrivals run 0-8 s, sessions last ~7 s
        log(f"swapping {SWAPPED} ({old['Id'][:12]}, image {old['Image'][:12]}) for image {fresh[:12]} "
            f"({revision})")
        start, end = stack.swap(SWAPPED)
        new = stack.state(SWAPPED)
        if new["Id"] == old["Id"] or new["Image"] != fresh:
            raise Failed(f"{SWAPPED} runs {new['Id'][:12]} from {new['Image'][:12]}: not a new container "
                         f"from the fresh image {fresh[:12]}")
        log(f"{SWAPPED} is now {new['Id'][:12]} from image {new['Image'][:12]}; swap window {end - start:.1f} s")
        sessions = replay.sessions()
        timings["swap replay"] = time.monotonic() - t
        verdict = judge(sessions, SWAPPED, start, end, require_complete=args.require_complete)
        log(verdict.summary())
        if not verdict.ok:
            raise Failed("swap: " + "\n  ".join(verdict.problems))

        t = time.monotonic()
        write_trace(work / "after.jsonl", args.sessions, 6.0, "after")
        after = Bench(port, work / "after.jsonl", work / "after.json", deadline).sessions()
        all_complete(after, "replay after the swap")
        if not any(s["decode_worker"] == SWAPPED for s in after):
            raise Failed(f"no session ran on the new {SWAPPED}")
        timings["replay after"] = time.monotonic() - t
    except (Failed, subprocess.TimeoutExpired) as exc:
        failed = True
        print(f"\nFAILED: {exc}", file=sys.stderr, flush=True)
        for name in names:
            print(stack.logs(name, 15), file=sys.stderr)
    finally:
        if not args.keep:
            t = time.monotonic()
            stack.down()
            timings["down"] = time.monotonic() - t
    log("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    if failed:
        return 1
    log("test-compose passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
