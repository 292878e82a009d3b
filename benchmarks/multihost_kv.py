"""KV read bandwidth over NIXL between two hosts against loopback: `make bench BENCH=multihost_kv`
(root: it builds the two network namespaces of tests/multihost/hosts.py, joined by a veth pair).

One process owns a KV pool filled with the known pattern (ampd.kv.kv_pattern); another READs from it
through NixlTransport, the workers' path, with UCX over TCP (UCX_TLS=tcp,self) and each process's
UCX bound to its address's interface as a worker's is. Paths: "between hosts" (owner on host 1,
reader on host 2, over the veth link) and "loopback" (both on host 1 over `lo`). Cases: contiguous
reads of 1, 8 and 32 MiB, and 512 scattered 16 KiB blocks in shuffled order (a session's KV spread
over a pool). Every read's bytes are checked against the pattern (outside the timed region).
The two paths are measured in turn, three times (a busy machine's load drifts); a case's result is
the median over all its timed reads (two warm-up reads before each set). Writes benchmarks/results/multihost_kv.json.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "multihost_kv.json"
BPT = 1024  # bytes per token
BT = 16  # tokens per block: 16 KiB blocks
NUM_BLOCKS = 2048  # 32 MiB pools
SESSION = "multihost-bench"
SCATTERED = 512
MSG = "@@"  # protocol lines on stdout start with this; anything else (UCX's chatter) is ignored


# ------------------------------------------------------------------------------ peer processes
def _say(obj) -> None:
    print(MSG + json.dumps(obj), flush=True)


def _hear() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the orchestrator went away
    return json.loads(line)


def _peer(role: str, host: str, reps: int, sizes_mib: list[int]) -> None:
    import asyncio

    import numpy as np

    from ampd.kv import KVPool, PoolLayout, Segment, kv_pattern
    from ampd.kv.transport import NixlTransport, bind_ucx_to

    bind_ucx_to(host)  # as a worker does: UCX on this address's interface only
    pool = KVPool(NUM_BLOCKS, BT, BPT)
    if role == "owner":
        pool.buffer[:] = kv_pattern(SESSION, 0, pool.capacity_tokens, BPT)
    tr = NixlTransport(f"kvbench-{role}", pool)
    _say({"md": base64.b64encode(tr.metadata()).decode(), "layout": tr.layout.to_dict()})
    peer = _hear()
    name = "kvbench-reader" if role == "owner" else "kvbench-owner"
    tr.add_peer(name, base64.b64decode(peer["md"]), PoolLayout.from_dict(peer["layout"]))
    _say({"ready": True})
    if role == "owner":
        _hear()  # "exit"
        tr.close()
        return
    _hear()  # "go": the owner knows this reader too
    rng = random.Random(0)
    shuffled = rng.sample(range(NUM_BLOCKS), SCATTERED)
    cases = [(f"{m} MiB contiguous", [Segment(b, 0, BT) for b in range(m * 1024 * 1024 // (BT * BPT))])
             for m in sizes_mib]
    cases.append((f"{SCATTERED} scattered 16 KiB blocks", [Segment(b, 0, BT) for b in shuffled]))
    results = []

    async def run():
        for label, remote in cases:
            local = [Segment(i, 0, BT) for i in range(len(remote))]
            nbytes = len(remote) * BT * BPT
            expected = np.concatenate([kv_pattern(SESSION, s.block * BT, BT, BPT) for s in remote])
            zeros = np.zeros(nbytes, dtype=np.uint8)
            times, bad = [], 0
            for i in range(reps + 2):
                pool.write(local, zeros)  # the check below sees this read's bytes only
                t0 = time.perf_counter()
                await tr.read(name, remote, local)
                dt = time.perf_counter() - t0
                bad += int(np.count_nonzero(pool.read(local) != expected))
                if i >= 2:
                    times.append(dt)
            med = statistics.median(times)
            results.append({"label": label, "bytes": nbytes, "median_ms": round(med * 1e3, 3),
                            "gbps": round(nbytes / med / 1e9, 4), "mismatched_bytes": bad, "reps": reps,
                            "times_ms": [round(t * 1e3, 3) for t in times]})

    asyncio.run(run())
    _say({"results": results})
    tr.close()


# ------------------------------------------------------------------------------ orchestration
class _Proc:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env, cwd=REPO)

    def hear(self, timeout_s: float = 120.0) -> dict:
        import select

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"peer exited ({self.p.wait()}): {self.p.stderr.read()[-2000:]}")
            if line.startswith(MSG):
                return json.loads(line[len(MSG):])
        raise RuntimeError(f"peer silent for {timeout_s:g} s")

    def say(self, obj) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


def _pair(hosts, owner: tuple[int, str], reader: tuple[int, str], reps: int, sizes_mib) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(PYTHONPATH=str(REPO), NIXL_LOG_LEVEL="WARN", UCX_TLS="tcp,self")
    sizes = ",".join(str(m) for m in sizes_mib)

    def argv(role, where):
        return hosts.wrap(where[0], [sys.executable, "-m", "benchmarks.multihost_kv", "--peer", role, "--host",
                                     where[1], "--reps", str(reps), "--sizes", sizes])
    a = _Proc(argv("owner", owner), env)
    b = None
    try:
        b = _Proc(argv("reader", reader), env)
        md_a, md_b = a.hear(), b.hear()
        a.say(md_b)
        b.say(md_a)
        a.hear()
        b.hear()
        b.say({"go": True})
        results = b.hear(timeout_s=300)["results"]
        a.say({"exit": True})
        return results
    finally:
        for p in (b, a):
            if p is not None:
                p.close()


def measure(hosts, reps: int = 10, sizes_mib=(1, 8, 32), rounds: int = 1) -> dict:
    """Both paths on ``hosts`` (tests.multihost.hosts.Hosts, entered), alternating ``rounds`` times
    (a busy machine's load drifts: each path sees the same share of it); each case's median over
    every repetition of every round."""
    paths = (("between hosts", (0, hosts.addr[0]), (1, hosts.addr[1])),
             ("loopback", (0, "127.0.0.1"), (0, "127.0.0.1")))
    merged: dict[tuple[str, str], dict] = {}
    for _ in range(rounds):
        for path, owner, reader in paths:
            for r in _pair(hosts, owner, reader, reps, sizes_mib):
                m = merged.setdefault((path, r["label"]), {"path": path, **r, "times_ms": [], "mismatched_bytes": 0,
                                                           "reps": 0})
                m["times_ms"] += r["times_ms"]
                m["mismatched_bytes"] += r["mismatched_bytes"]
                m["reps"] += r["reps"]
    cases = []
    for m in merged.values():
        med = statistics.median(m["times_ms"]) / 1e3
        times = sorted(m.pop("times_ms"))
        cases.append({**m, "median_ms": round(med * 1e3, 3), "gbps": round(m["bytes"] / med / 1e9, 4),
                      "p10_ms": times[len(times) // 10], "p90_ms": times[len(times) * 9 // 10]})
    ratio = {}
    for c in cases:
        if c["path"] == "between hosts":
            lo = next(x for x in cases if x["path"] == "loopback" and x["label"] == c["label"])
            ratio[c["label"]] = round(c["gbps"] / lo["gbps"], 3)
    return {"cases": cases, "between_hosts_over_loopback": ratio}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", choices=("owner", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=10, help="timed reads per case, path and round")
    ap.add_argument("--rounds", type=int, default=3, help="times the two paths are measured in turn")
    ap.add_argument("--sizes", default="1,8,32", help="contiguous read sizes, MiB (comma-separated)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if args.peer:
        _peer(args.peer, args.host, args.reps, sizes)
        return
    sys.path.insert(0, str(REPO))
    from tests.multihost.hosts import Hosts, HostsError

    try:
        with Hosts() as hosts:
            result = measure(hosts, args.reps, sizes, args.rounds)
    except HostsError as exc:
        sys.exit(f"multihost_kv: cannot build the two hosts: {exc}")
    result.update(
        transport="NIXL 1.5.1, UCX backend, UCX_TLS=tcp,self; each process's UCX bound to its address's interface",
        hosts="two network namespaces on one machine joined by a veth pair (10.213.0.1, 10.213.0.2); "
              "loopback: both processes in the first, on 127.0.0.1",
        loadavg=open("/proc/loadavg").read().split()[:3],
        cpus=os.cpu_count(),
    )
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    for c in result["cases"]:
        print(f"{c['path']:>14}: {c['label']:<30} {c['gbps']:7.3f} GB/s  ({c['median_ms']} ms, "
              f"{c['mismatched_bytes']} bytes wrong)")
    print(f"between hosts / loopback: {result['between_hosts_over_loopback']}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
