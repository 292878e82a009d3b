"""Prefix scopes, live (--prefix-sharing; OpenSession.prefix_scope, docs/kv.md "Prefix sharing"): Redis,
a coordinator, two mock decode workers with their sidecars and the OpenAI front with API keys naming
tenants. A shared KV block shows in whoever shares it (cached_tokens, TTFT), so two tenants sending the
same prompt never share one, while one tenant's sessions still do, wherever admission alone would
put them (the coordinator's binding hashes each tenant's prompt as its decode worker does). A gRPC
client's scope is checked like any field; plain gRPC sessions share within the scope they name."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from ampd import grpcserver, perf
from ampd.coordinators import session_events
from ampd.launcher import Deployment, Options
from ampd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from ampd.validate import MAX_ID

pytestmark = pytest.mark.timeout(180)

MODEL = "smollm2-135m-instruct"
NS = "prefix-scope"
TENANTS = ("acme", "globex")
KEYS = {t: f"key-of-{t}-0123456789abcdef" for t in TENANTS}
PROMPT = "our quarterly numbers are confidential: " + "revenue figures and margins " * 60
# A decode worker publishes the blocks its index holds within 50 ms (services/decode/prefixpub.py):
# each request waits that long after the last, so that the binding sees every earlier session's
# blocks, and an unscoped hash would move a session onto another tenant's holder
PUBLISHED_S = 0.3


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix-scope")
    d = json.loads((Path(perf.__file__).parent / "profiles" / "zero@none.json").read_text())
    d["name"] = "prefixscope@test"
    d["tp"]["1"]["kv_capacity_tokens"] = 16_384
    (tmp / "prefixscope@test.json").write_text(json.dumps(d))
    (tmp / "api-keys").write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    opts = Options(prefill="none", decode="tp1*2", profile=str(tmp / "prefixscope@test.json"), policy="local",
                   prefix_sharing=True, redis_url=redis_url, namespace=NS, session_ttl=120.0,
                   api_keys=str(tmp / "api-keys"), run_dir=str(tmp / "run"))
    with Deployment(opts, frontend=True) as dep:
        yield dep


def ask(url: str, tenant: str, text: str) -> dict:
    time.sleep(PUBLISHED_S)
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {KEYS[tenant]}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(e.read().decode()) from None


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_tenants_never_share_prefix_blocks_and_one_tenants_sessions_do(dep):
    url = dep.frontend
    a1 = ask(url, "acme", PROMPT)
    assert cached(a1) == 0 and a1["usage"]["prompt_tokens"] > 256
    g1 = ask(url, "globex", PROMPT)  # the same prompt: nothing of acme's shows
    assert cached(g1) == 0 and g1["ampd"]["l_hist"] == 0, g1
    # acme again, a new session (its first still holds a longer history): its own tenant's blocks,
    # on the worker that holds them whichever worker admission picked
    a2 = ask(url, "acme", PROMPT)
    assert a2["ampd"]["session_id"] != a1["ampd"]["session_id"]
    assert cached(a2) >= a1["usage"]["prompt_tokens"] - 32, a2
    g2 = ask(url, "globex", PROMPT)  # globex's own blocks now
    assert cached(g2) >= g1["usage"]["prompt_tokens"] - 32, g2


def _open(scope: str, sid: str) -> coordinator_pb2.ClientMessage:
    turn = common_pb2.Turn(token_ids=list(range(1, 301)), sampling=common_pb2.SamplingParams(max_tokens=2))
    return coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=sid, turn=turn, prefix_scope=scope))


def test_grpc_sessions_share_within_the_scope_they_name_and_a_too_long_scope_is_invalid(dep):
    async def scenario() -> list[int]:
        ch = grpcserver.channel(dep.coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [ev async for ev in session_events(stub.Session(iter([_open("x" * (MAX_ID + 1), "long")]), timeout=30))]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("open.prefix_scope:"), info.value.details()
        shared = []
        for i, scope in enumerate(("team-1", "team-2", "team-1", "")):
            events = [ev async for ev in session_events(stub.Session(iter([_open(scope, f"grpc-{i}")]), timeout=30))]
            ends = [ev.round_end for ev in events if ev.HasField("round_end")]
            assert ends and events[-1].HasField("done"), events
            shared.append(ends[0].timing.prefix_shared_tokens)
        await ch.close()
        return shared

    first, other_scope, same_scope, shared_scope = asyncio.run(scenario())
    assert first == 0 and other_scope == 0 and shared_scope == 0
    assert same_scope >= 256
