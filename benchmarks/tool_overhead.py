"""Latency of one trivial tool call through a live sidecar (what isolating calls in processes costs).

``python -m benchmarks.tool_overhead [--calls N]`` starts ``python -m services.sidecar`` with the
calculator tool, makes N sequential ``Call``s of ``{"expression": "1 + 1"}`` (and of the built-in
``replay`` with no latency) and prints each one's P50, P90 and P99 in milliseconds, as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ampd import grpcserver
from ampd.v1 import sidecar_pb2, sidecar_pb2_grpc


def start_sidecar(run_dir: Path) -> tuple[subprocess.Popen, str]:
    ready = run_dir / "sidecar.port"
    proc = subprocess.Popen([sys.executable, "-m", "services.sidecar", "--port", "0", "--ready-file", str(ready),
                             "--tool", "calculator=ampd.chat.calculator:calculator"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the sidecar did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{grpcserver.read_ready_file(ready)['port']}"


def quantiles(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=100)
    return {"p50_ms": round(q[49], 3), "p90_ms": round(q[89], 3), "p99_ms": round(q[98], 3)}


async def measure(address: str, calls: int) -> dict[str, dict[str, float]]:
    async with grpcserver.channel(address) as ch:
        stub = sidecar_pb2_grpc.ToolSidecarStub(ch)
        await stub.ListTools(sidecar_pb2.ListToolsRequest(), timeout=30, wait_for_ready=True)
        out = {}
        for name, args in (("calculator", '{"expression": "1 + 1"}'), ("replay", "")):
            ms = []
            for i in range(calls + 20):  # the first 20 warm up
                t0 = time.perf_counter()
                await stub.Call(sidecar_pb2.ToolCallRequest(name=name, arguments=args), timeout=30)
                if i >= 20:
                    ms.append((time.perf_counter() - t0) * 1e3)
            out[name] = quantiles(ms)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_sidecar(Path(tmp))
        try:
            print(json.dumps(asyncio.run(measure(address, args.calls)), indent=1))
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
