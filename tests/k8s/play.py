"""`make test-k8s`, live part: deploy/k8s run for real under `podman kube play`, and a decode pod
replaced mid-replay.

1. builds the AMPD and Redis images as `make test-compose` does (tests/compose/stack.py; cached
   layers when it ran first) and renders the mock overlay with `kubectl kustomize`, its images
   pointed at them;
2. turns each Deployment into its Pods (tests/k8s/kube.py says what podman does not do that a
   cluster does) and plays them on a podman network tier by tier (Redis; the workers and the
   planner; the coordinator; the front), each pod ready, by its own readiness probes run from the
   host against the pod's address as a kubelet does, before the next tier;
3. replays a short tool-using trace through the front (`ampd bench --api openai`): every session
   completes;
4. while a second replay runs, replaces the pod decode-0 as a Deployment's rollout would: stops it
   (SIGTERM, its terminationGracePeriodSeconds), removes it and plays a new pod, decode-2, from the
   same template. Sessions were open on decode-0 (its ampd_sessions_bound gauge, read just before),
   and 0 sessions are lost: every session completes;
5. replays once more: every session completes, and some ran on decode-2;
6. removes every pod it played and its network, also when a step fails.

Run as root (rootful podman, as CI does), after tests/compose/setup.sh:
`.venv/bin/python tests/k8s/play.py`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "tests" / "compose")]
from kube import by_kind, play_file, pod_for_podman, pod_names, probe_of, render  # noqa: E402
from stack import IMAGE, REDIS_IMAGE, Bench, Failed, build_images, log, run, write_trace  # noqa: E402

from ampd.healthcheck import check_grpc, check_http  # noqa: E402

NETWORK = "ampd-k8s-test"
LABEL = {"ampd.test": "k8s"}
# Tiers by the pods' app.kubernetes.io/component label: what each needs is up before it starts (a
# cluster starts them all at once and restarts the ones whose peers are not up yet).
TIERS = (("state",), ("worker", "planner"), ("coordinator",), ("frontend",))
REPLACED, REPLACEMENT = "decode-0", "decode-2"


def pod_ip(pod: str) -> str:
    info = json.loads(run(["podman", "pod", "inspect", pod], quiet=True).stdout)
    info = info[0] if isinstance(info, list) else info
    infra = json.loads(run(["podman", "inspect", info["InfraContainerID"]], quiet=True).stdout)[0]
    return infra["NetworkSettings"]["Networks"][NETWORK]["IPAddress"]


def probe(how: str, ip: str, port: int, path: str) -> str:
    """'' when the probe passes, else why not: what a kubelet's grpc, httpGet or tcpSocket probe does."""
    if how == "grpc":
        return check_grpc(f"{ip}:{port}", 3.0)
    if how == "http":
        return check_http(f"http://{ip}:{port}{path}", 3.0)
    try:
        socket.create_connection((ip, port), timeout=3.0).close()
        return ""
    except OSError as exc:
        return f"{ip}:{port}: {exc}"


def metric(ip: str, port: int, name: str, labels: str = "") -> float:
    """The sum of a Prometheus metric's samples whose labels contain `labels`."""
    text = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


class Cluster:
    """The pods this test played, by name -> (Deployment, podman Pod object)."""

    def __init__(self, objs: list[dict], secret: dict[str, str], work: Path):
        self.objs, self.secret, self.work = objs, secret, work
        self.deployments = by_kind(objs, "Deployment")
        self.pods: dict[str, tuple[dict, dict]] = {}
        self.plays = 0

    def pod(self, deployment: str, name: str) -> dict:
        return pod_for_podman(self.deployments[deployment], name, self.secret, LABEL)

    def play(self, pods: list[tuple[str, dict]]) -> None:
        self.plays += 1
        f = self.work / f"play-{self.plays}.yaml"
        f.write_text(play_file(self.objs, [p for _, p in pods]))
        run(["podman", "kube", "play", "--network", NETWORK, str(f)], timeout=300)
        for dep, p in pods:
            self.pods[p["metadata"]["name"]] = (self.deployments[dep], p)

    def wait_ready(self, names: list[str], timeout_s: float = 240.0) -> None:
        t = time.monotonic()
        waiting = {n: "" for n in names}
        while waiting:
            for name in sorted(waiting):
                dep = self.pods[name][0]
                for c in dep["spec"]["template"]["spec"]["containers"]:
                    st = self.state(f"{name}-{c['name']}")
                    if st.get("Status") != "running" or st.get("RestartCount", 0):
                        raise Failed(f"{name}/{c['name']} is {st.get('Status')} (exit {st.get('ExitCode')}, "
                                     f"restarts {st.get('RestartCount', 0)}):\n{self.logs(name)}")
                why = ""
                try:
                    ip = pod_ip(name)
                    for c in dep["spec"]["template"]["spec"]["containers"]:
                        how, port, path = probe_of(c)
                        if why := probe(how, ip, port, path):
                            break
                except Failed as exc:
                    why = str(exc)
                if why:
                    waiting[name] = why
                else:
                    del waiting[name]
            if waiting and time.monotonic() - t > timeout_s:
                raise Failed(f"not ready after {timeout_s:.0f} s: {waiting}\n" +
                             "\n".join(self.logs(n) for n in sorted(waiting)))
            if waiting:
                time.sleep(1.0)
        log(f"ready: {' '.join(names)} ({time.monotonic() - t:.1f} s)")

    @staticmethod
    def state(container: str) -> dict:
        p = run(["podman", "inspect", container], check=False, quiet=True)
        if p.returncode:
            return {}
        info = json.loads(p.stdout)[0]
        return {**info.get("State", {}), "RestartCount": info.get("RestartCount", 0)}

    def logs(self, pod: str, tail: int = 30) -> str:
        out = []
        for c in self.pods[pod][0]["spec"]["template"]["spec"]["containers"]:
            p = run(["podman", "logs", "--tail", str(tail), f"{pod}-{c['name']}"], check=False, quiet=True)
            out.append(f"--- {pod}/{c['name']} (last {tail} lines)\n{p.stdout}{p.stderr}")
        return "\n".join(out)

    def replace(self, old: str, new: str) -> tuple[float, float]:
        """As a rollout replaces a pod: stop `old` within its grace period, remove it, play `new` from the
        same template, ready. Returns (start, end) on the wall clock."""
        dep = self.pods[old][0]
        grace = dep["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        start = time.time()
        run(["podman", "pod", "stop", "-t", str(grace), old], timeout=grace + 60)
        log(f"{old} stopped after {time.time() - start:.1f} s")
        run(["podman", "pod", "rm", old])
        self.pods.pop(old)
        self.play([(dep["metadata"]["name"], self.pod(dep["metadata"]["name"], new))])
        self.wait_ready([new])
        return start, time.time()


def cleanup() -> None:
    """Every pod this test plays (its label) and its network: leftovers of an interrupted run too."""
    ids = run(["podman", "pod", "ps", "-q", "--filter", "label=" + "=".join(*LABEL.items())],
              check=False, quiet=True).stdout.split()
    if ids:  # nothing to keep: SIGKILL (a stop would give each container its grace period in turn)
        run(["podman", "pod", "kill", *ids], check=False, quiet=True, timeout=120)
        run(["podman", "pod", "rm", "-f", "-t", "0", *ids], check=False, quiet=True, timeout=300)
    run(["podman", "network", "rm", "-f", NETWORK], check=False, quiet=True)


def rendered(overlay: str, work: Path) -> list[dict]:
    """The overlay rendered by `kubectl kustomize`, through a kustomization of the test's own that only
    points its images at the local builds."""
    k = work / "kustomize"
    k.mkdir()
    (k / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(ROOT / "deploy/k8s/overlays" / overlay, k)],
        "images": [{"name": "ampd", "newName": IMAGE.rsplit(":", 1)[0], "newTag": IMAGE.rsplit(":", 1)[1]},
                   {"name": "redis", "newName": REDIS_IMAGE.rsplit(":", 1)[0], "newTag": REDIS_IMAGE.rsplit(":", 1)[1]}],
    }))
    return render(k, os.environ.get("KUBECTL", "kubectl"))


def all_complete(report: dict, what: str) -> None:
    n, done = report["sessions"], report["completed"]
    if done != n:
        raise Failed(f"{what}: {done} of {n} sessions completed, {report.get('failed')} failed (0 may be lost)")
    log(f"{what}: {done} of {n} completed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=16, help="sessions per replay (default 16)")
    p.add_argument("--keep", action="store_true", help="leave the pods up at the end")
    args = p.parse_args(argv)
    if args.sessions < 4:
        p.error("--sessions must be >= 4")
    if os.geteuid() != 0:
        raise SystemExit("tests/k8s/play.py runs podman as root (rootful, as CI does): run it as root")
    os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "tests/compose/containers.conf"))
    # `timeout` (CI) sends SIGTERM: end through the `finally` below, which removes the pods
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = os.environ.get("AMPD_BASE_IMAGE", "localhost/debian-py:bookworm")
    work = Path(tempfile.mkdtemp(prefix="ampd-k8s-"))
    timings: dict[str, float] = {}
    deadline = 90.0  # per-session client deadline
    failed = False
    cluster = None
    try:
        t = time.monotonic()
        # The mock overlay's image: the Dockerfile with the front's tokenizer (overlays/mock says so).
        build_images(base, "a", {"WITH_TOKENIZER": "true"})
        timings["build"] = time.monotonic() - t
        objs = rendered("mock", work)
        cluster = Cluster(objs, {"AMPD_INTERNAL_TOKEN": secrets.token_urlsafe(32)}, work)

        cleanup()
        run(["podman", "network", "create", NETWORK])
        t = time.monotonic()
        for tier in TIERS:
            pods = [(name, cluster.pod(name, pod)) for name, d in cluster.deployments.items()
                    if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") in tier
                    for pod in pod_names(d)]
            cluster.play(pods)
            cluster.wait_ready([pod["metadata"]["name"] for _, pod in pods])
        missing = set(cluster.deployments) - {d["metadata"]["name"] for d, _ in cluster.pods.values()}
        if missing:
            raise Failed(f"Deployments in no tier (their app.kubernetes.io/component): {sorted(missing)}")
        timings["up"] = time.monotonic() - t
        front = f"http://{pod_ip('frontend')}:8000"

        t = time.monotonic()
        write_trace(work / "warm.jsonl", args.sessions, 6.0, "warm")
        all_complete(Bench(0, work / "warm.jsonl", work / "warm.json", deadline, url=front).report(), "replay")
        timings["replay"] = time.monotonic() - t

        t = time.monotonic()
        write_trace(work / "swap.jsonl", args.sessions, 8.0, "swap")
        replay = Bench(0, work / "swap.jsonl", work / "swap.json", deadline, url=front)
        replay.started.wait(60)
        time.sleep(5.0)  # mid-replay: arrivals run 0-8 s, sessions last ~7 s
        bound = metric(pod_ip(REPLACED), 9061, "ampd_sessions_bound")
        log(f"replacing pod {REPLACED} ({bound:.0f} sessions open on it) with {REPLACEMENT}")
        start, end = cluster.replace(REPLACED, REPLACEMENT)
        log(f"replace window {end - start:.1f} s")
        all_complete(replay.report(), "replay across the replacement")
        logs = run(["podman", "logs", "coordinator-coordinator"], check=False, quiet=True)
        moved = [ln for ln in (logs.stdout + logs.stderr).splitlines() if "moving the session" in ln]
        log(f"the coordinator moved {len(moved)} sessions off {REPLACED}" +
            "".join(f"\n    {ln[-200:]}" for ln in moved[:3]))
        if bound < 1:
            raise Failed(f"no session was open on {REPLACED} when it was replaced: the check shows nothing "
                         "(more or longer sessions in the trace)")
        timings["replace replay"] = time.monotonic() - t

        t = time.monotonic()
        write_trace(work / "after.jsonl", args.sessions, 6.0, "after")
        all_complete(Bench(0, work / "after.jsonl", work / "after.json", deadline, url=front).report(),
                     "replay after the replacement")
        opened = metric(pod_ip(REPLACEMENT), 9061, "ampd_decode_sessions_total", 'status="opened"')
        if opened < 1:
            raise Failed(f"no session ran on the new pod {REPLACEMENT}")
        log(f"{REPLACEMENT} served {opened:.0f} sessions")
        timings["replay after"] = time.monotonic() - t
    except Exception as exc:  # noqa: BLE001 - any failure: report it, clean up, fail
        failed = True
        print(f"\nFAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if cluster is not None:
            for name in sorted(cluster.pods):
                print(cluster.logs(name, 15), file=sys.stderr)
    finally:
        if not args.keep:
            t = time.monotonic()
            cleanup()
            timings["down"] = time.monotonic() - t
    log("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    if failed:
        return 1
    log("test-k8s (podman kube play) passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
