"""The planner service over real gRPC on loopback: a subprocess, health, reflection, plans, profiles."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ampd import grpcserver
from ampd.v1 import planner_pb2, planner_pb2_grpc
from ampd.workload import dump_trace, generate

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    d = tmp_path_factory.mktemp("planner")
    extra = d / "profiles"
    extra.mkdir()
    # a stored profile beside the shipped ones (as `ampd profile --out` would write it)
    doc = json.loads((ROOT / "ampd/perf/profiles/qwen3-32b@h20.json").read_text())
    doc["name"] = "measured@box"
    (extra / "measured@box.json").write_text(json.dumps(doc))
    ready = d / "port"
    proc = subprocess.Popen([sys.executable, "-m", "services.planner", "--port", "0", "--ready-file", str(ready),
                             "--profiles-dir", str(extra)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, AMPD_LOG_LEVEL="WARNING"))
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"planner did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    yield f"127.0.0.1:{grpcserver.read_ready_file(ready)['port']}"
    proc.terminate()
    proc.wait(20)


def _trace_text(tmp_path, n=20) -> str:
    p = tmp_path / "t.jsonl"
    dump_trace(generate("toolbench", 1.0, 60.0, 5)[:n], p)
    return p.read_text()


async def _call(address, method, request, timeout=180):
    ch = grpcserver.channel(address)
    try:
        stub = planner_pb2_grpc.PlannerStub(ch)
        return await getattr(stub, method)(request, timeout=timeout)
    finally:
        await ch.close()


def test_health_and_stored_profiles(planner):
    async def go():
        ch = grpcserver.channel(planner)
        h = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="ampd.v1.Planner"), timeout=10)
        await ch.close()
        return h
    assert asyncio.run(go()).status == health_pb2.HealthCheckResponse.SERVING
    listed = asyncio.run(_call(planner, "ListProfiles", planner_pb2.ListProfilesRequest()))
    names = {p.name: p for p in listed.profiles}
    assert {"llama3.1-70b@h20", "qwen3-32b@h20", "mixtral-8x7b@h20", "measured@box"} <= set(names)
    assert list(names["llama3.1-70b@h20"].tps) == [2, 4, 8]
    got = asyncio.run(_call(planner, "GetProfile", planner_pb2.GetProfileRequest(name="measured@box")))
    assert json.loads(got.json)["name"] == "measured@box"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_call(planner, "GetProfile", planner_pb2.GetProfileRequest(name="nope@x")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "profile: no stored profile 'nope@x'" in e.value.details()


def test_plan_over_grpc(planner, tmp_path):
    req = planner_pb2.PlanRequest(profile="qwen3-32b@h20", trace_jsonl=_trace_text(tmp_path), gpus=4, top=2,
                                  ttft_slo_s=1.5, itl_slo_s=0.05, candidates=3)
    reply = asyncio.run(_call(planner, "Plan", req))
    # the 3 best over the whole space, then the 3 best of each family (co-located, disaggregated) they miss
    assert reply.gpus == 4 and len(reply.top) == 2 and 3 <= reply.candidates_checked <= 11  # + the balanced splits
    assert reply.top[0].slo_attainment >= reply.top[1].slo_attainment
    doc = json.loads(reply.json)
    assert set(doc) >= {"gpus", "seconds", "top"}
    assert [(t["prefill"], t["decode"]) for t in doc["top"]] == [(t.prefill, t.decode) for t in reply.top]
    for t in reply.top:
        assert t.gpus <= 4 and 0 <= t.slo_attainment <= 1


def test_too_few_gpus_and_bad_fields(planner, tmp_path):
    text = _trace_text(tmp_path, 5)
    cases = [
        (dict(profile="llama3.1-70b@h20", trace_jsonl=text, gpus=1), grpc.StatusCode.FAILED_PRECONDITION,
         "gpus: 1 GPUs cannot hold one replica of llama3.1-70b@h20"),
        (dict(profile="llama3.1-70b@h20", trace_jsonl=text, gpus=3, no_colocated=True),
         grpc.StatusCode.FAILED_PRECONDITION, "gpus: 3 GPUs cannot hold one prefill and one decode replica"),
        (dict(profile="llama3.1-70b@h20", trace_jsonl=text, gpus=0), grpc.StatusCode.INVALID_ARGUMENT, "gpus:"),
        (dict(profile="llama3.1-70b@h20", trace_jsonl='{"id": "a"}\n', gpus=8), grpc.StatusCode.INVALID_ARGUMENT,
         "trace_jsonl: line 1"),
        (dict(profile="llama3.1-70b@h20", trace_jsonl="", gpus=8), grpc.StatusCode.INVALID_ARGUMENT,
         "trace_jsonl: the trace has no sessions"),
        (dict(profile="llama3.1-70b@h20", trace_jsonl=text, gpus=8, policy="nope"),
         grpc.StatusCode.INVALID_ARGUMENT, "policy: unknown policy"),
        (dict(profile="nope@x", trace_jsonl=text, gpus=8), grpc.StatusCode.NOT_FOUND, "profile:"),
    ]
    for fields, code, text_part in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(_call(planner, "Plan", planner_pb2.PlanRequest(**fields)))
        assert e.value.code() == code, (fields, e.value.details())
        assert text_part in e.value.details(), (fields, e.value.details())
