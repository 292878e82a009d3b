"""Abuse: issue 24's attacks against a live deployment, each measured as a user of the front sees it.

A local deployment as `ampd up --prefill 1 --decode 2 --engine mock` starts it (Redis, coordinator, one
prefill and two decode workers with their sidecars, the OpenAI front), with two API keys (two tenants).
Each attack runs alone, while a probe asks the front's `/health` every 50 ms. Per attack:

- ``status``: what the attack got (HTTP status counts, or the gRPC code), and ``seconds`` it took;
- ``health_max_ms``: the slowest `/health` answer during the attack (and ``health_failed``: none in time);
- ``front_rss_mb``: the front's resident memory before, at its peak during, and after the attack;
- ``after``: a normal chat right after the attack (status, seconds): nobody else is degraded.

At the end every log of the deployment is searched for the marker string that every attack's payload
carries (``marker_in_logs``: must be 0), and the namespace's Redis keys are counted once every session
is closed by stopping the front (``redis_keys_left``: the worker registry only).

    python -m benchmarks.abuse                # results/abuse.json (make bench BENCH=abuse)
"""
from __future__ import annotations

import asyncio
import os
import platform
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx2
import redis

from benchmarks import write_json
from ampd.launcher import Deployment, Options

RESULTS = Path(__file__).parent / "results"
MARKER = "ABUSE-MARKER-5c1e"
MODEL = "smollm2-135m-instruct"
KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-0123456789"}
NS = "abuse"


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Probe:
    """Asks /health every 50 ms and keeps the slowest answer and the front's peak RSS."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.worst = 0.0
        self.failed = 0
        self.peak_rss = 0.0
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        async with httpx2.AsyncClient(timeout=5.0) as c:
            while True:
                t0 = time.perf_counter()
                try:
                    r = await c.get(self.url + "/health")
                    if r.status_code != 200:
                        self.failed += 1
                except httpx2.HTTPError:
                    self.failed += 1
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.peak_rss = max(self.peak_rss, rss_mb(self.pid))
                await asyncio.sleep(0.05)

    def __enter__(self) -> "Probe":
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


class Bench:
    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.url = dep.frontend
        self.front_pid = next(c.proc.pid for c in dep.children if c.name == "frontend")
        self.results: dict[str, dict] = {}

    def client(self, tenant: str = "alice", timeout: float = 60.0) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(base_url=self.url, timeout=timeout,
                                  headers={"authorization": f"Bearer {KEYS[tenant]}"},
                                  limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None))

    async def normal(self) -> dict:
        t0 = time.perf_counter()
        async with self.client() as c:
            r = await c.post("/v1/chat/completions", json=chat("hello"))
        return {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 3)}

    async def run(self, name: str, attack) -> None:
        print(f"attack {name}", file=sys.stderr)
        before = rss_mb(self.front_pid)
        t0 = time.perf_counter()
        with Probe(self.url, self.front_pid) as probe:
            try:
                out = await attack()
            except Exception as exc:  # an attack that breaks the bench is itself a finding
                out = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            seconds = time.perf_counter() - t0
            after = await self.normal()
        out.update(seconds=round(seconds, 3), health_max_ms=round(probe.worst * 1e3, 1),
                   health_failed=probe.failed, after=after,
                   front_rss_mb={"before": round(before), "peak": round(probe.peak_rss),
                                 "after": round(rss_mb(self.front_pid))})
        self.results[name] = out
        print(f"  {out}", file=sys.stderr)

    # --------------------------------------------------------------------------------- attacks
    async def nested_tools(self) -> dict:
        params: dict = {"type": "string", "description": MARKER}
        for _ in range(450):  # 900 levels of JSON, under orjson's own 1,024: the front's own bound must act
            params = {"type": "object", "properties": {"x": params}}
        body = chat(MARKER, tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])
        async with self.client() as c:
            r = await c.post("/v1/chat/completions", content=_dumps(body), headers={"content-type": "application/json"})
        return {"status": r.status_code, "error": r.json().get("error", {}).get("message", "")[:200]}

    async def chunked_body(self, mb: int = 256) -> dict:
        async def chunks():
            yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + MARKER.encode()
            block = b"x" * (1 << 20)
            for _ in range(mb):
                yield block
            yield b'"}]}'
        async with self.client(timeout=120.0) as c:
            r = await c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        return {"status": r.status_code, "body_mb": mb}

    async def huge_message(self) -> dict:
        async with self.client() as c:
            r = await c.post("/v1/chat/completions", json=chat(MARKER + " " + "y " * (5 << 20)))
        return {"status": r.status_code, "message_mb": 10}

    async def many_messages(self) -> dict:
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{MARKER} {i}"} for i in range(100_001)]
        async with self.client() as c:
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4})
        return {"status": r.status_code, "messages": len(msgs)}

    async def out_of_range(self) -> dict:
        async with self.client() as c:
            r = await c.post("/v1/chat/completions", json=chat(MARKER, max_tokens=2 ** 31))
            u = await c.post("/v1/chat/completions", json=chat(MARKER, logprobs=True))
        return {"status": {"max_tokens_2^31": r.status_code, "logprobs": u.status_code},
                "param": {"max_tokens_2^31": r.json()["error"].get("param"), "logprobs": u.json()["error"].get("param")}}

    async def burst(self, n: int = 300, timeout: float = 120.0) -> dict:
        async with self.client(timeout=timeout) as c:
            async def one(i: int):
                t0 = time.perf_counter()
                try:
                    r = await c.post("/v1/chat/completions", json=chat(f"{MARKER} burst {i}"))
                    return r.status_code, time.perf_counter() - t0
                except httpx2.HTTPError as exc:
                    return type(exc).__name__, time.perf_counter() - t0
            got = await asyncio.gather(*(one(i) for i in range(n)))
        t_end = time.perf_counter()
        while True:  # how soon after the burst a normal chat is served
            if (await self.normal())["status"] == 200 or time.perf_counter() - t_end > 60:
                break
            await asyncio.sleep(0.1)
        return {"concurrent": n, "status": dict(Counter(str(s) for s, _ in got)),
                "slowest_s": round(max(t for _, t in got), 3), "normal_after_s": round(time.perf_counter() - t_end, 3)}

    async def idle_kv_fill(self, n: int = 24, tokens: int = 5800) -> dict:
        """Completions of ``tokens`` prompt tokens and max_tokens 1, left idle: do they lock out a new chat?"""
        statuses = Counter()
        async with self.client() as c:
            for i in range(n):
                prompt = [1000 + i] + [7 + (j % 5000) for j in range(tokens - 1)]
                r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
                statuses[r.status_code] += 1
            metrics = (await c.get("/metrics")).text
        evicted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("ampd_frontend_sessions_evicted{"))
        return {"sessions": n, "prompt_tokens": tokens, "status": dict(statuses), "evicted": evicted}

    async def cross_tenant(self) -> dict:
        """Bob resends Alice's conversation: his answer must show none of her cached tokens."""
        msgs = [{"role": "user", "content": f"{MARKER} alice's private question " + "z " * 40}]
        async with self.client("alice") as a, self.client("bob") as b:
            r1 = (await a.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4})).json()
            follow = msgs + [r1["choices"][0]["message"], {"role": "user", "content": "and then?"}]
            rb = (await b.post("/v1/chat/completions", json={"model": MODEL, "messages": follow, "max_tokens": 4})).json()
            ra = (await a.post("/v1/chat/completions", json={"model": MODEL, "messages": follow, "max_tokens": 4})).json()
        cached = lambda r: (r.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # noqa: E731
        return {"bob_cached_tokens": cached(rb), "alice_cached_tokens": cached(ra),
                "same_session": rb.get("ampd", {}).get("session_id") == ra.get("ampd", {}).get("session_id")}

    async def stopped_decode_worker(self, stop_s: float = 15.0, sessions: int = 8) -> dict:
        """SIGSTOP one decode worker for ``stop_s`` while chats run, then SIGCONT: every chat must end."""
        victim = next(c for c in self.dep.children if c.name == "decode-0")
        async with self.client(timeout=stop_s + 60) as c:
            async def one(i: int):
                t0 = time.perf_counter()
                try:
                    r = await c.post("/v1/chat/completions", json=chat(f"{MARKER} s{i}", max_tokens=64))
                    return r.status_code, time.perf_counter() - t0
                except httpx2.HTTPError as exc:
                    return type(exc).__name__, time.perf_counter() - t0
            tasks = [asyncio.create_task(one(i)) for i in range(sessions)]
            await asyncio.sleep(0.2)
            os.kill(victim.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(stop_s)
            finally:
                os.kill(victim.proc.pid, signal.SIGCONT)
            got = await asyncio.gather(*tasks)
        return {"stopped_s": stop_s, "status": dict(Counter(str(s) for s, _ in got)),
                "slowest_s": round(max(t for _, t in got), 3)}


    async def runaway_tool(self) -> dict:
        """The calculator expression that froze a sidecar, sent straight to one, with ListTools asked meanwhile."""
        import grpc

        from ampd import grpcserver
        from ampd.v1 import sidecar_pb2, sidecar_pb2_grpc

        address = self._decode_info().sidecar
        async with grpcserver.channel(address) as ch:
            stub = sidecar_pb2_grpc.ToolSidecarStub(ch)
            t0 = time.perf_counter()
            call = asyncio.ensure_future(stub.Call(sidecar_pb2.ToolCallRequest(
                session_id="abuse", name="calculator", arguments='{"expression": "((9**999)**999)**999"}'), timeout=60))
            t1 = time.perf_counter()
            await stub.ListTools(sidecar_pb2.ListToolsRequest(), timeout=5)
            list_s = time.perf_counter() - t1
            try:
                r = await call
                got = {"error": r.error[:120], "content": r.content[:120]}
            except grpc.aio.AioRpcError as exc:
                got = {"grpc": exc.code().name}
            return {**got, "call_s": round(time.perf_counter() - t0, 3), "list_tools_s": round(list_s, 3)}

    async def raw_attach(self) -> dict:
        """An Attach of 60,000 tokens straight to a decode worker, without the coordinator's attach token."""
        import grpc

        from ampd import grpcserver
        from ampd.v1 import common_pb2, decode_pb2, decode_pb2_grpc

        info = self._decode_info()
        req = decode_pb2.AttachRequest(session_secret="s" * 32, open=common_pb2.OpenSession(
            session_id="abuse-attach", turn=common_pb2.Turn(token_ids=list(range(1, 60_001)),
                                                            sampling=common_pb2.SamplingParams(max_tokens=1))))
        async with grpcserver.channel(info.address) as ch:
            try:
                async for _ in decode_pb2_grpc.DecodeWorkerStub(ch).Attach(req, timeout=10):
                    pass
                return {"grpc": "OK"}
            except grpc.aio.AioRpcError as exc:
                return {"grpc": exc.code().name, "details": (exc.details() or "")[:120]}

    def _decode_info(self):
        from ampd.state.store import WorkerInfo

        raw = redis.Redis.from_url(self.dep.redis_url).hgetall(f"{NS}:workers")
        return next(i for i in map(WorkerInfo.from_json, raw.values()) if i.kind == "decode")


def _dumps(obj) -> bytes:
    """JSON of a deeply nested object (json.dumps recurses past Python's limit; this does not)."""
    import json

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        return json.dumps(obj).encode()
    finally:
        sys.setrecursionlimit(old)


def main() -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="abuse-"))
    keys = run_dir / "api-keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    opts = Options(prefill="tp1*1", decode="tp1*2", engine="mock", namespace=NS, run_dir=str(run_dir),
                   api_keys=str(keys), tool=("calculator=ampd.chat.calculator:calculator",))
    t0 = time.time()
    out: dict = {"command": "python -m benchmarks.abuse",
                 "deployment": "ampd up --prefill 1 --decode 2 --engine mock (front on, two API keys)",
                 "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                             "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}}
    with Deployment(opts, frontend=True, supervise=False) as dep:
        bench = Bench(dep)

        async def all_attacks() -> None:
            for name in ("nested_tools", "chunked_body", "huge_message", "many_messages", "out_of_range",
                         "cross_tenant", "runaway_tool", "raw_attach", "burst", "idle_kv_fill",
                         "stopped_decode_worker"):
                await bench.run(name, getattr(bench, name))

        asyncio.run(all_attacks())
        out["attacks"] = bench.results
        front = dep.child("frontend").proc  # a front that stops closes its sessions: what is left leaked
        front.send_signal(signal.SIGTERM)
        front.wait(timeout=30)
        time.sleep(1.0)
        r = redis.Redis.from_url(dep.redis_url)
        keys_left = [k.decode() for k in r.scan_iter(f"{NS}:*")]
        out["redis_keys_left"] = {"count": len(keys_left),
                                  "without_ttl": sorted(k for k in keys_left if r.ttl(k) == -1)[:20]}
    out["marker_in_logs"] = sum(p.read_text(errors="replace").count(MARKER) for p in run_dir.glob("*.log"))
    out["wall_s"] = round(time.time() - t0, 1)
    out["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(str(RESULTS / "abuse.json"), out)
    print(f"wrote {RESULTS / 'abuse.json'}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
