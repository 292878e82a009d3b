"""The floor under the coordinator's CPU per round: what a bare grpc.aio server on uvloop spends per
message, with no AMPD code at all (issue 27, item 5: "say where the time goes").

A server process serves one bidirectional stream method that answers every message with one of the
same size (a round's messages through the coordinator are small: token ids, route decisions), and a
unary method that reports its own CPU time. A client process keeps `--streams` streams ping-ponging
for `--seconds`. The server's CPU seconds over the messages it read and wrote is the per-message
floor; a round through the coordinator is six gRPC messages (coordinator_capacity.json's `reading`),
so `1 / (6 x floor)` bounds the rounds/s one coordinator on one core can route with grpc.aio, before
any routing, logging or Redis.

    python -m benchmarks.grpc_floor [--streams 32] [--seconds 6] [--size 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "grpc_floor.json"
METHOD, CPU = "/floor.Floor/Echo", "/floor.Floor/Cpu"
MESSAGES_PER_ROUND = 6  # coordinator_capacity.json's reading: 3 in, 3 out per round
COORDINATOR_CAPACITY = Path(__file__).resolve().parent / "results" / "coordinator_capacity.json"


def _identity(b: bytes) -> bytes:
    return b


async def _serve(port: int) -> None:
    import grpc

    async def echo(requests, context):
        async for msg in requests:
            yield msg

    async def cpu(_req, context):
        return json.dumps({"cpu_s": time.process_time()}).encode()

    handler = grpc.method_handlers_generic_handler("floor.Floor", {
        "Echo": grpc.stream_stream_rpc_method_handler(echo, _identity, _identity),
        "Cpu": grpc.unary_unary_rpc_method_handler(cpu, _identity, _identity),
    })
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _drive(port: int, streams: int, seconds: float, size: int) -> dict:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        echo = ch.stream_stream(METHOD, _identity, _identity)
        cpu = ch.unary_unary(CPU, _identity, _identity)
        payload = b"x" * size
        counts = [0] * streams
        stop = asyncio.Event()

        async def one(i: int) -> None:
            call = echo()
            while not stop.is_set():
                await call.write(payload)
                await call.read()
                counts[i] += 1
            await call.done_writing()

        # warm up: one exchange per stream, then count from a reading of the server's CPU
        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        await asyncio.sleep(1.0)
        before, n0, t0 = json.loads(await cpu(b"")), sum(counts), time.perf_counter()
        await asyncio.sleep(seconds)
        after, n1, t1 = json.loads(await cpu(b"")), sum(counts), time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    exchanges = n1 - n0
    server_cpu = after["cpu_s"] - before["cpu_s"]
    return {"exchanges": exchanges, "wall_s": round(t1 - t0, 3), "server_cpu_s": round(server_cpu, 3),
            "messages": 2 * exchanges, "messages_per_s": round(2 * exchanges / (t1 - t0), 1),
            "server_cpu_us_per_message": round(1e6 * server_cpu / (2 * exchanges), 2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--size", type=int, default=64, help="bytes per message")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.streams < 1 or a.seconds <= 0 or a.size < 0:
        ap.error("--streams >= 1, --seconds > 0, --size >= 0")
    import uvloop

    if a.serve:
        uvloop.run(_serve(a.serve))
        return
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_floor", "--serve", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("grpc_floor: the server did not start")
        got = uvloop.run(_drive(port, a.streams, a.seconds, a.size))
    finally:
        server.terminate()
        server.wait(timeout=10)
    floor_us = got["server_cpu_us_per_message"]
    out = {
        "command": "make bench BENCH=grpc_floor",
        "machine": platform.platform(), "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
        "streams": a.streams, "size_bytes": a.size, **got,
        "messages_per_round": MESSAGES_PER_ROUND,
        "floor_cpu_ms_per_round": round(MESSAGES_PER_ROUND * floor_us / 1000, 3),
        "floor_rounds_per_s": round(1e6 / (MESSAGES_PER_ROUND * floor_us), 1),
    }
    if COORDINATOR_CAPACITY.is_file():
        pts = json.loads(COORDINATOR_CAPACITY.read_text())["coordinators_1"]["points"]
        coord = min(p["cpu_ms_per_round"]["coordinator"] for p in pts)
        out["coordinator_cpu_ms_per_round"] = coord
        out["floor_share_of_coordinator"] = round(out["floor_cpu_ms_per_round"] / coord, 3)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
