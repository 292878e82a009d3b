"""The front under bad and random requests, on a mock-engine deployment with the zero-cost profile:
every bad field is an HTTP 400 in OpenAI's error shape naming the field, the front keeps serving,
hypothesis-made bodies never crash it (no 5xx, no traceback), and no session outlives its TTL
(the front closes it, the decode worker frees its KV, the Redis records go)."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampd.front.index import SessionIndex
from ampd.launcher import Deployment, Options
from ampd.state import connect
from ampd.state.local import free_port
from tests.integration.fronts import extra_front

pytestmark = pytest.mark.timeout(300)

TTL_S = 1.5
MODEL = "smollm2-135m-instruct"
NS = "front-requests"


COORDINATOR_PORT = free_port()


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    opts = Options(prefill="tp1*1", decode="tp1*1", profile="zero@none", policy="ampd", redis_url=redis_url,
                   namespace=NS, session_ttl=TTL_S, run_dir=str(tmp_path_factory.mktemp("run")),
                   port=COORDINATOR_PORT)
    with Deployment(opts, frontend=True) as d:
        yield d


def test_the_coordinator_binds_the_port_asked_for(dep):
    assert dep.coordinator == f"127.0.0.1:{COORDINATOR_PORT}"


def post(url: str, body, path: str = "/v1/chat/completions", headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json",
                                                                  **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if not raw.startswith(b"data:") else {"sse": raw.decode()})
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(content: str = "hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def _error(status: int, body: dict, expect_status: int, param) -> None:
    assert status == expect_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    assert "Traceback" not in body["error"]["message"]


def test_bad_requests_get_400_naming_the_field_and_the_front_keeps_serving(dep):
    url = dep.frontend
    s, b = post(url, b"{not json")
    _error(s, b, 400, None)
    assert "malformed JSON" in b["error"]["message"]
    _error(*post(url, {"model": MODEL}), 400, "messages")
    _error(*post(url, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400, "messages[0].role")
    _error(*post(url, chat(max_tokens=-3)), 400, "max_tokens")
    orphan = {"model": MODEL, "messages": [{"role": "user", "content": "q"},
                                           {"role": "tool", "tool_call_id": "call_9", "content": "r"}]}
    _error(*post(url, orphan), 400, "messages[1].tool_call_id")
    _error(*post(url, chat(model="gpt-9")), 404, "model")
    # the mock's decode worker has no text: a stop string is refused by it, named as the request's field
    _error(*post(url, chat(stop=["x"])), 400, "stop")
    s, b = post(url, chat())
    assert s == 200 and b["choices"][0]["message"]["role"] == "assistant"
    assert b["usage"]["completion_tokens"] == 4 and b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    s, b = post(url, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}, "/v1/completions")
    assert s == 200 and b["usage"]["completion_tokens"] == 3
    models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_a_header_continues_its_session_and_a_busy_one_is_refused(dep):
    url = dep.frontend
    h = {"x-session-id": "hdr-1"}
    s1, b1 = post(url, chat("first"), headers=h)
    assert s1 == 200 and b1["ampd"]["session_id"] == "hdr-1"
    convo = [{"role": "user", "content": "first"}, b1["choices"][0]["message"], {"role": "user", "content": "next"}]
    s2, b2 = post(url, {"model": MODEL, "messages": convo, "max_tokens": 4}, headers=h)
    assert s2 == 200 and b2["ampd"]["session_id"] == "hdr-1"
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == b1["usage"]["prompt_tokens"] + 4 - 1


def _front_sessions(url: str) -> int:
    return json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())["sessions"]


def _gauge(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _wait_no_sessions(dep, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (_front_sessions(dep.frontend) == 0
                and _gauge(dep.metrics["decode-0"], "ampd_sessions_bound") == 0
                and _gauge(dep.metrics["decode-0"], "ampd_kv_cache_blocks", state="used") == 0
                and _gauge(dep.metrics["coordinator"], "ampd_sessions_active") == 0):
            break
        time.sleep(0.2)

    async def records():
        r = await connect(dep.redis_url)
        try:
            return await SessionIndex(r, NS, TTL_S).live_sessions()
        finally:
            await r.aclose()

    assert _front_sessions(dep.frontend) == 0
    assert _gauge(dep.metrics["decode-0"], "ampd_sessions_bound") == 0
    assert _gauge(dep.metrics["decode-0"], "ampd_kv_cache_blocks", state="used") == 0  # the KV is freed
    assert _gauge(dep.metrics["coordinator"], "ampd_sessions_active") == 0
    assert asyncio.run(records()) == []


def test_idle_sessions_close_after_the_ttl_and_free_their_kv(dep):
    s, _ = post(dep.frontend, chat("stay a while"))
    assert s == 200
    assert _front_sessions(dep.frontend) >= 1
    assert _gauge(dep.metrics["decode-0"], "ampd_kv_cache_blocks", state="used") > 0  # its KV, held idle
    _wait_no_sessions(dep)
    assert _gauge(dep.frontend + "/metrics", "ampd_frontend_sessions_expired") >= 1


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 70) | st.floats(allow_nan=True) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                     max_leaves=8)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot", 3]),
                                  "content": st.one_of(st.text(max_size=20), st.none(), _json)},
                                 optional={"tool_call_id": st.text(max_size=4), "tool_calls": _json,
                                           "name": st.text(max_size=4)})
_field_values = {
    "model": st.sampled_from([MODEL, MODEL, "other", 7]),
    "messages": st.lists(_message, max_size=3) | _json,
    "max_tokens": st.integers(-2, 6) | _json, "max_completion_tokens": st.integers(-1, 4),
    "temperature": st.floats(-1, 3) | _json, "top_p": st.floats(-0.5, 1.5), "seed": st.integers(-2, 2**65),
    "n": st.integers(0, 3), "stream": st.booleans() | _json, "stop": st.none() | st.lists(st.text(max_size=3), max_size=2),
    "tools": _json, "tool_choice": _json, "prompt": st.text(max_size=12) | st.lists(st.integers(-1, 60000), max_size=5),
    "stream_options": _json, "ignore_eos": st.booleans(),
}
_body = st.fixed_dictionaries({}, optional=_field_values) | _json


@pytest.mark.timeout(600)
def test_fuzzed_requests_never_crash_the_front_nor_leak_a_session(dep):
    url = dep.frontend
    seen: set[int] = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=_body, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def one(body, path):
        if isinstance(body, dict) and "max_tokens" not in body:
            body = {**body, "max_tokens": 3}
        try:
            raw = json.dumps(body).encode()
        except ValueError:
            raw = b"{"
        status, reply = post(url, raw, path)
        seen.add(status)
        assert status in (200, 400, 404, 409, 429), reply
        if status != 200:
            assert set(reply["error"]) == {"message", "type", "param", "code"}

    one()
    assert 400 in seen
    s, _ = post(url, chat("still serving"))
    assert s == 200
    _wait_no_sessions(dep)


def test_a_second_front_agrees_and_guards_with_its_token(dep, tmp_path):
    """A second front on the same deployment and Redis index, with a token: a conversation the first
    front holds, resent to the second, continues on the first (forwarded), with its cached tokens."""
    with extra_front(dep.coordinator, dep.redis_url, tmp_path / "front.port", "--namespace", NS, "--auth-token",
                     "s3cret", "--session-ttl", str(TTL_S)) as url:
        s, b = post(url, chat())
        assert s == 401 and b["error"]["code"] == "invalid_api_key"
        s, b = post(url, chat(), headers={"authorization": "Bearer wrong"})
        assert s == 401
        for path in ("/health", "/healthz"):  # open despite the token: probes carry none (deploy/k8s)
            assert json.loads(urllib.request.urlopen(url + path, timeout=10).read())["status"] == "ok"
        key = {"authorization": "Bearer s3cret"}
        s1, b1 = post(dep.frontend, chat("where does this go?"))
        assert s1 == 200
        convo = [{"role": "user", "content": "where does this go?"}, b1["choices"][0]["message"],
                 {"role": "user", "content": "and now?"}]
        s2, b2 = post(url, {"model": MODEL, "messages": convo, "max_tokens": 4}, headers=key)
        assert s2 == 200, b2
        assert b2["ampd"]["session_id"] == b1["ampd"]["session_id"]
        assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == b1["usage"]["prompt_tokens"] + 4 - 1
    _wait_no_sessions(dep)


def test_the_openai_replay_continues_every_session_through_the_front(dep):
    """`ampd bench --api openai`: each round resends the history; every later round is a continuation
    (its l_hist is the previous rounds' prompt and output, less the last output token)."""
    from ampd.bench.openai_client import replay_openai
    from ampd.workload import Round, Session

    trace = [Session(id=f"r{i}", arrival=0.1 * i, rounds=(Round(40, 5, tool_s=0.05), Round(12, 3, tool_s=0.0),
                                                          Round(7, 4))) for i in range(3)]
    records, stats, _, labels = asyncio.run(replay_openai(dep.frontend, trace, progress=False))
    assert not stats.errors and labels["model"] == MODEL
    for rec in records:
        assert rec.completed
        assert [(r.l_hist, r.l_incr) for r in rec.rounds] == [(0, 40), (44, 13), (59, 8)]
    assert stats.cached_tokens == 3 * (44 + 59)
    _wait_no_sessions(dep)
