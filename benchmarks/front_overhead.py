"""What the OpenAI-compatible front adds per turn, and whether a replay through it sees the SLO the
gRPC replay sees.

1. **Added latency per turn** (``latency``): a mock deployment on the zero-cost profile
   (``zero@none``: every modelled cost is 0, so a turn's latency is the path itself), 1 prefill + 1
   decode worker of TP 1, the front beside the coordinator. Sessions one at a time (latency, not
   queueing), ``ROUNDS`` rounds each, ``INPUT`` new tokens and ``OUTPUT`` output tokens per round,
   no tool time. A turn's latency is the client's: from sending the round's input to receiving its
   first token.

   - ``grpc``: the bench's gRPC client (`ampd bench --client-tools`): the session's stream stays
     open, each later round is one Turn message with only the new tokens;
   - ``front_http``: a minimal HTTP/1.1 client on a kept-alive connection: each round POSTs
     `/v1/completions` with the whole history (every earlier prompt and output id) plus the new
     input, streamed; the front finds the session by the history's prefix and sends only the new
     tokens on. What the front itself adds: the HTTP request, JSON of the whole history, the Redis
     index look-up, the answer's SSE chunks;
   - ``front_bench``: the same rounds with `ampd bench --api openai`'s client (httpx2, a new
     client per session as a replay has), which adds its own request building and parsing.

   The three paths take turns session by session, so that they see the same load on the box.
   ``added`` is each front path's percentile minus the gRPC path's (P50, P99).

2. **SLO attainment** (``slo``): the same toolbench trace replayed at the same deployment (mock
   engines timed by ``SLO_PROFILE``, the demo's shape) through gRPC with tools on the client and
   through the front with `ampd bench --api openai`, at each rate of ``SLO_RATES``. Both wait out
   each tool time in the client. The mock decodes at the profile's GPU speed, so every output token
   crosses the coordinator (and, through the front, one more process) at that rate: on a small CPU
   box the front's per-token work competes for the cores with every other process.

Writes benchmarks/results/front_overhead.json (``make bench BENCH=front_overhead``).
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from ampd.bench.client import replay
from ampd.bench.openai_client import replay_openai
from ampd.bench.report import SLO, build_report
from ampd.launcher import Deployment, Options
from ampd.workload import Round, Session, filler_ids, generate

RESULTS = Path(__file__).parent / "results"
SESSIONS, ROUNDS, INPUT, OUTPUT = 21, 8, 256, 4  # the first session of each path is a warm-up
SLO_PROFILE = "qwen3-32b@h20"
SLO_TRACE = dict(preset="toolbench", duration=30.0, seed=1)
SLO_RATES = (0.5, 1.0)  # sessions per second
TTFT_SLO, ITL_SLO = 2.0, 0.1
MODEL = "smollm2-135m-instruct"


def latency_sessions() -> list[Session]:
    rs = tuple(Round(input=INPUT, output=OUTPUT, tool_s=0.0) for _ in range(ROUNDS - 1)) + (
        Round(input=INPUT, output=OUTPUT),)
    return [Session(id=f"lat-{i:03d}", arrival=0.0, rounds=rs) for i in range(SESSIONS)]


def summary(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"samples": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 3),
            "p90_ms": round(float(np.percentile(a, 90)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3)}


# ------------------------------------------------------------------------------ the three paths
async def grpc_latency(address: str, s: Session) -> list[float]:
    _, stats, _, _ = await replay(address, [s], client_tools=True, progress=False)
    assert not stats.errors, stats.errors
    return stats.client_latency


class _Http:
    """One kept-alive HTTP/1.1 connection; a streamed POST returns (first-token seconds, output ids)."""

    def __init__(self, url: str) -> None:
        self.host, self.port = url.removeprefix("http://").split(":")
        self.r = self.w = None

    async def post_stream(self, path: str, body: dict) -> tuple[float, list[int]]:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection(self.host, int(self.port))
        data = json.dumps(body, separators=(",", ":")).encode()
        t0 = time.perf_counter()
        self.w.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(data)}\r\n\r\n".encode() + data)
        status = await self.r.readline()
        assert b" 200 " in status, status
        while (await self.r.readline()) != b"\r\n":  # headers
            pass
        first, ids = None, []
        while True:  # chunked transfer encoding: size line, data, CRLF
            size = int((await self.r.readline()).strip(), 16)
            if size == 0:
                await self.r.readline()
                break
            payload = (await self.r.readexactly(size + 2))[:-2]
            for line in payload.split(b"\n"):
                if not line.startswith(b"data: {"):
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("token_ids"):
                        if first is None:
                            first = time.perf_counter() - t0
                        ids.extend(c["token_ids"])
        return first, ids

    async def close(self) -> None:
        if self.w is not None:
            self.w.close()


async def front_http_latency(http: "_Http", s: Session) -> list[float]:
    out: list[float] = []
    history: list[int] = []
    for r in s.rounds:
        prompt = history + filler_ids(r.input, len(history))
        first, ids = await http.post_stream("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": r.output, "stream": True, "ignore_eos": True,
            "return_token_ids": True})
        out.append(first)
        history = prompt + ids
    return out


async def front_bench_latency(url: str, s: Session) -> tuple[list[float], int, int]:
    records, stats, _, _ = await replay_openai(url, [s], progress=False)
    assert not stats.errors, stats.errors
    return [r.first_token - r.input_ready for rec in records for r in rec.rounds], stats.cached_tokens, \
        stats.prompt_tokens


def measure_latency(run_dir: Path) -> dict:
    opts = Options(prefill="tp1*1", decode="tp1*1", profile="zero@none", policy="ampd", namespace="front-lat",
                   run_dir=str(run_dir / "latency"))
    with Deployment(opts, frontend=True) as dep:
        async def all_paths():
            g, h, o, cached, prompt = [], [], [], 0, 0
            http = _Http(dep.frontend)
            try:
                # the paths take turns, session by session, so that they see the same load on the box;
                # the first session of each warms up connections and first-use costs
                for i, s in enumerate(latency_sessions()):
                    lat_g = await grpc_latency(dep.coordinator, s)
                    lat_h = await front_http_latency(http, s)
                    lat_o, c, p = await front_bench_latency(dep.frontend, s)
                    if i:
                        g, h, o, cached, prompt = g + lat_g, h + lat_h, o + lat_o, cached + c, prompt + p
            finally:
                await http.close()
            return g, h, o, cached, prompt

        g, h, o, cached, prompt = asyncio.run(all_paths())
    out = {"grpc": summary(g), "front_http": summary(h), "front_bench": summary(o),
           "front_bench_cached_prompt_fraction": round(cached / prompt, 4) if prompt else None}
    out["added"] = {k: {q: round(out[k][q] - out["grpc"][q], 3) for q in ("p50_ms", "p99_ms")}
                    for k in ("front_http", "front_bench")}
    return out


def measure_slo(run_dir: Path, rate: float) -> dict:
    sessions = generate(SLO_TRACE["preset"], rate, SLO_TRACE["duration"], SLO_TRACE["seed"])
    slo = SLO(TTFT_SLO, ITL_SLO)
    out: dict = {"trace": {**SLO_TRACE, "rate": rate}, "sessions": len(sessions), "profile": SLO_PROFILE,
                 "deployment": "prefill tp2*2, decode tp2*2, policy ampd", "ttft_slo": TTFT_SLO, "itl_slo": ITL_SLO}
    for api in ("grpc", "openai"):
        opts = Options(prefill="tp2*2", decode="tp2*2", profile=SLO_PROFILE, policy="ampd",
                       namespace=f"front-slo-{api}-{rate:g}", ttft_slo=TTFT_SLO, itl_slo=ITL_SLO,
                       run_dir=str(run_dir / f"slo-{api}-{rate:g}"))
        with Deployment(opts, frontend=api == "openai") as dep:
            if api == "grpc":
                records, stats, wall, _ = asyncio.run(replay(dep.coordinator, sessions, client_tools=True,
                                                             progress=False))
            else:
                records, stats, wall, _ = asyncio.run(replay_openai(dep.frontend, sessions, progress=False))
        rep = build_report("ampd", records, slo, wall)
        out[api] = {k: rep[k] for k in ("slo_attainment", "completed", "failed", "local_fraction", "ttft_s", "itl_s")
                    if k in rep}
        out[api]["errors"] = stats.errors[:5]
    out["attainment_gap_points"] = round(abs(out["grpc"]["slo_attainment"] - out["openai"]["slo_attainment"]) * 100, 2)
    return out


def main() -> None:
    import tempfile

    run_dir = Path(tempfile.mkdtemp(prefix="front-overhead-"))
    t0 = time.time()
    result = {
        "command": "python -m benchmarks.front_overhead" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform(), "load_average_at_start": os.getloadavg()},
        "shape": {"sessions": SESSIONS, "rounds": ROUNDS, "input": INPUT, "output": OUTPUT},
        "latency": measure_latency(run_dir),
    }
    if "--latency-only" not in sys.argv:
        result["slo"] = [measure_slo(run_dir, rate) for rate in SLO_RATES]
    result["wall_s"] = round(time.time() - t0, 1)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "front_overhead.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
