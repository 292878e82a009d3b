"""The client side of the two-host test, run on one of the hosts (it must reach the coordinator's
and the workers' addresses): ``python -m tests.multihost.drive SPEC.json OUT.json``.

SPEC: {"coordinator": ADDR, "sessions": [{"id", "start_s", "turns": [[ids, n_out, [[tool_in, tool_out]...]]...]}],
"verify_mock": bool, "workers": {id: [kind, addr]}, "timeout_s"}. Runs every session (each from its
start time), and writes per session its output tokens in order, its rounds (prefill worker, local,
tokens), the decode workers it saw and its error (""), plus each worker's Metrics afterwards.
With verify_mock, every token is checked against the mock engine's token at its position.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import grpc

from ampd import grpcserver
from ampd.coordinators import session_events
from ampd.engine.mock import token_at
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.integration.rpc_metrics import service_metrics


def _sampling(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=n, ignore_eos=True)


def _turn(ids, n_out, calls) -> common_pb2.Turn:
    return common_pb2.Turn(token_ids=ids, sampling=_sampling(n_out), script=[common_pb2.ScriptedCall(
        tool=common_pb2.ToolSpec(name="replay", latency_s=0.2), result_tokens=n_in, sampling=_sampling(o))
        for n_in, o in calls])


async def run_session(stub, s: dict, verify_mock: bool, timeout_s: float) -> dict:
    turns = s["turns"]
    outbox: asyncio.Queue = asyncio.Queue()
    await outbox.put(coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=s["id"],
                                                                                turn=_turn(*turns[0]))))

    async def requests():
        while (m := await outbox.get()) is not None:
            yield m

    tokens, rounds, decode, nxt, error, wrong = [], [], set(), 1, "", 0
    try:
        async for ev in session_events(stub.Session(requests(), timeout=timeout_s)):
            if ev.decode_worker:
                decode.add(ev.decode_worker)
            kind = ev.WhichOneof("event")
            if kind == "tokens":
                t = ev.tokens
                if verify_mock:
                    wrong += sum(tok != token_at(s["id"], t.position + i) for i, tok in enumerate(t.token_ids))
                tokens.extend(t.token_ids)
            elif kind == "turn_end":
                await outbox.put(coordinator_pb2.ClientMessage(turn=_turn(*turns[nxt])) if nxt < len(turns) else None)
                nxt += 1
            elif kind == "done":
                rounds = [{"round": r.round, "prefill_worker": r.prefill_worker, "local": r.local, "tokens": r.tokens,
                           "l_hist": r.l_hist} for r in ev.done.rounds]
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    await outbox.put(None)
    return {"id": s["id"], "tokens": tokens, "rounds": rounds, "decode_workers": sorted(decode), "error": error,
            "wrong_tokens": wrong}


async def main(spec: dict) -> dict:
    ch = grpcserver.channel(spec["coordinator"])
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    t0 = time.monotonic()

    async def one(s):
        await asyncio.sleep(max(0.0, s["start_s"] - (time.monotonic() - t0)))
        return await run_session(stub, s, spec.get("verify_mock", False), spec.get("timeout_s", 120))

    if spec.get("sequential"):  # one at a time: a real engine's greedy tokens do not depend on batching
        sessions = [await one(s) for s in spec["sessions"]]
    else:
        sessions = list(await asyncio.gather(*(one(s) for s in spec["sessions"])))
    wall = time.monotonic() - t0
    await ch.close()
    metrics = {wid: await service_metrics(addr, kind) for wid, (kind, addr) in spec.get("workers", {}).items()}
    return {"sessions": sessions, "wall_s": wall, "metrics": metrics}


if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    grpcserver.set_internal_token(os.environ.get("AMPD_INTERNAL_TOKEN", ""))  # the workers' Metrics need it
    out = asyncio.run(main(spec))
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
