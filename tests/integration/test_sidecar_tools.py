"""Tool calls isolated and bounded (issue 24 finding 5), live: a deployment (Redis, coordinator, a
prefill and a decode worker, its sidecar with the calculator and runaway tools; mock engines), and
the sidecar's tool processes on their own.

Found: `((9**999)**999)**999` passed the calculator's check on the exponent; the sidecar stopped
answering ListTools and spun for minutes past the call's deadline, and every tool session on its
decode worker ended ABORTED. `(10**1000)**1000` raised INTERNAL. Any client could run any sidecar
tool with its own arguments through Turn.script.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import grpc
import psutil
import pytest
import redis

from ampd import grpcserver
from ampd.launcher import Deployment, Options
from ampd.tools import ToolInput, ToolLimits
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, decode_pb2, decode_pb2_grpc
from ampd.v1 import sidecar_pb2, sidecar_pb2_grpc
from services.sidecar.pool import ToolProcesses

pytestmark = pytest.mark.timeout(120)

NS = "tools"
WALL_S = 2.0
SLACK_S = 2.0  # a kill and the answer's way back, on a loaded 2-core box
TOOLS = ("calculator=ampd.chat.calculator:calculator", "spin=sidecar_test_tools:spin",
         "hog=sidecar_test_tools:hog")
RUNAWAYS = ("((9**999)**999)**999", "(10**1000)**1000")


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    here = str(Path(__file__).parent)  # sidecar_test_tools, for the sidecar's tool processes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
        opts = Options(prefill="tp8*1", decode="tp1*1", policy="threshold", redis_url=redis_url, namespace=NS,
                       tool=TOOLS, tool_wall_s=WALL_S, tool_cpu_s=60, tool_workers=2, tool_memory_mb=256,
                       script_tools=("replay", "calculator"), run_dir=str(tmp_path_factory.mktemp("run")))
        with Deployment(opts) as d:
            yield d
            tool_pids = tool_processes(d)
    assert tool_pids and not [p for p in tool_pids if psutil.pid_exists(p)], "tool processes outlived the sidecar"


def decode_info(redis_url):
    from ampd.state.store import WorkerInfo

    raw = redis.Redis.from_url(redis_url).hgetall(f"{NS}:workers")
    return next(i for i in map(WorkerInfo.from_json, raw.values()) if i.kind == "decode")


def tool_processes(d: Deployment) -> set[int]:
    """The sidecar's live children (zombies are left behind too: they count)."""
    return {c.pid for c in psutil.Process(d.child("sidecar-0").proc.pid).children()}


def calc(expression: str) -> sidecar_pb2.ToolCallRequest:
    return sidecar_pb2.ToolCallRequest(session_id="s", name="calculator",
                                       arguments=json.dumps({"expression": expression}))


async def timed(aw) -> tuple[object, float]:
    t0 = time.monotonic()
    out = await aw
    return out, time.monotonic() - t0


def test_a_runaway_call_is_stopped_at_its_deadline_and_the_sidecar_keeps_serving(dep, redis_url):
    before = tool_processes(dep)
    assert len(before) == 2

    async def scenario():
        async with grpcserver.channel(decode_info(redis_url).sidecar) as ch:
            stub = sidecar_pb2_grpc.ToolSidecarStub(ch)
            spin = asyncio.ensure_future(timed(stub.Call(sidecar_pb2.ToolCallRequest(name="spin"), timeout=30)))
            await asyncio.sleep(0.3)  # it spins now, in one tool process
            listed, list_s = await timed(stub.ListTools(sidecar_pb2.ListToolsRequest(), timeout=5))
            _, metrics_s = await timed(stub.Metrics(common_pb2.MetricsRequest(), timeout=5))
            other, other_s = await timed(stub.Call(calc("6 * 7"), timeout=5))  # the other tool process
            runaways = [await timed(stub.Call(calc(e), timeout=5)) for e in RUNAWAYS]
            result, spin_s = await spin
            return listed, list_s, metrics_s, other, other_s, runaways, result, spin_s

    listed, list_s, metrics_s, other, other_s, runaways, result, spin_s = asyncio.run(scenario())
    assert "spin" in listed.names and list_s < 1.0 and metrics_s < 1.0
    assert other.content == "42" and other_s < 2.0
    for out, took in runaways:  # the calculator refuses them before computing anything
        assert out.content.startswith("error: the result would have about ") and not out.error, out
        assert took < 1.0
    # an error result, not a gRPC error: the session that made the call goes on
    assert result.error == f"the tool did not answer within {WALL_S:g} s and was stopped"
    assert result.content == f"error: {result.error}" and result.result_tokens == 0
    assert WALL_S - 0.1 < spin_s < WALL_S + SLACK_S
    # the killed process was reaped (no zombie) and replaced
    deadline = time.monotonic() + 30
    while (now := tool_processes(dep)) == before or len(now) != 2:
        assert time.monotonic() < deadline, now
        time.sleep(0.1)
    assert len(before - now) == 1 and not psutil.pid_exists((before - now).pop())

    async def after():
        async with grpcserver.channel(decode_info(redis_url).sidecar) as ch:
            stub = sidecar_pb2_grpc.ToolSidecarStub(ch)
            return [await stub.Call(calc(f"{i} * 7"), timeout=5) for i in range(4)], await stub.Metrics(
                common_pb2.MetricsRequest(), timeout=5)

    outs, metrics = asyncio.run(after())
    assert [o.content for o in outs] == ["0", "7", "14", "21"]
    assert metrics.values["stopped"] >= 1 and metrics.values["failures"] >= 1


@pytest.fixture
def test_tools_path(monkeypatch):
    """sidecar_test_tools importable by the tool processes this test starts."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p))


def test_a_call_answers_before_its_callers_deadline(test_tools_path):
    """A caller that gives 1.5 s gets an error result in time, not DEADLINE_EXCEEDED."""
    async def scenario():
        procs = ToolProcesses(["spin=sidecar_test_tools:spin"], ToolLimits(cpu_s=60, wall_s=30, memory_mb=256), 1)
        await procs.start()
        try:
            return await timed(procs.call("spin", ToolInput("s", 0, {}, 0.0, 0), budget_s=1.25))
        finally:
            await procs.close()

    (out, error), took = asyncio.run(scenario())
    assert out is None and error == "the tool did not answer within 1.25 s and was stopped"
    assert took < 1.25 + SLACK_S


def test_cpu_time_and_memory_are_limited_in_the_tool_process(test_tools_path):
    async def scenario():
        procs = ToolProcesses(["spin=sidecar_test_tools:spin", "hog=sidecar_test_tools:hog",
                               "calculator=ampd.chat.calculator:calculator"],
                              ToolLimits(cpu_s=1, wall_s=60, memory_mb=256), 1)
        await procs.start()
        call = ToolInput("s", 0, {"expression": "6 * 7"}, 0.0, 0)
        try:
            spun = await timed(procs.call("spin", call, budget_s=60))
            hogged = await procs.call("hog", call, budget_s=60)
            normal = await procs.call("calculator", call, budget_s=60)
            return spun, hogged, normal, procs.stopped, len(procs.procs), [p.popen for p in procs.procs]
        finally:
            await procs.close()

    ((out, error), took), hogged, normal, stopped, alive, popens = asyncio.run(scenario())
    assert out is None and error == "the tool used more than 1 s of CPU time and was stopped"
    assert took < 30  # 1 to 2 s of CPU (the limit is whole seconds, over the process's own use)
    assert hogged == (None, "the tool ran out of memory (limit 256 MiB)")  # the process lives on
    assert normal[0].content == "42" and stopped == 1 and alive == 1
    assert all(p.returncode is not None for p in popens)  # close() reaped them


# ----------------------------------------------------------------------- Turn.script's allowlist
def opening(*calls: common_pb2.ScriptedCall) -> common_pb2.OpenSession:
    return common_pb2.OpenSession(session_id=uuid.uuid4().hex, turn=common_pb2.Turn(
        token_ids=list(range(1, 20)), sampling=common_pb2.SamplingParams(max_tokens=2), script=list(calls)))


def scripted(name: str, arguments: dict) -> common_pb2.ScriptedCall:
    return common_pb2.ScriptedCall(tool=common_pb2.ToolSpec(name=name, arguments=json.dumps(arguments)),
                                   result_tokens=3, sampling=common_pb2.SamplingParams(max_tokens=2))


def session(address: str, o: common_pb2.OpenSession) -> tuple[grpc.StatusCode, str, list]:
    with grpc.insecure_channel(address) as ch:
        call = coordinator_pb2_grpc.CoordinatorStub(ch).Session(
            iter([coordinator_pb2.ClientMessage(open=o)]), timeout=30)
        events = []
        try:
            events.extend(ev for batch in call for ev in batch.events)
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), events
        return grpc.StatusCode.OK, "", events


def test_a_script_may_name_only_the_tools_allowed_for_scripting(dep, redis_url):
    code, details, _ = session(dep.coordinator, opening(scripted("replay", {}), scripted("spin", {})))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("open.turn.script[1].tool.name: 'spin' may not be scripted"), details

    # the decode worker checks it too: Attach is reachable without the coordinator
    async def attach():
        async with grpcserver.channel(decode_info(redis_url).address) as ch:
            stream = decode_pb2_grpc.DecodeWorkerStub(ch).Attach(decode_pb2.AttachRequest(
                open=opening(scripted("hog", {})), arrival=time.time(), session_secret="x"), timeout=10)
            try:
                async for _ in stream:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""

    code, details = asyncio.run(attach())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("open.turn.script[0].tool.name:")


def test_a_scripted_runaway_is_an_error_result_and_the_session_goes_on(dep):
    """The calculator is allowed here: the runaway expressions come back as error results and the
    session runs its next round and completes (it ended ABORTED before)."""
    o = opening(*(scripted("calculator", {"expression": e}) for e in RUNAWAYS))
    t0 = time.monotonic()
    code, details, events = session(dep.coordinator, o)
    assert code == grpc.StatusCode.OK, details
    assert time.monotonic() - t0 < 10
    done = [e for e in events if e.HasField("done")]
    assert done and len(done[0].done.rounds) == 3
