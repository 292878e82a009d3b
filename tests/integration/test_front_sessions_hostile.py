"""The front's sessions against hostile clients (issue 24, findings 3, 6 and 10), on a live mock
deployment (Redis, coordinator, a decode worker with its sidecar, the front) whose decode worker
holds KV_TOKENS of KV, with API keys naming tenants:

- another tenant's resent conversation or `x-session-id` never reaches a session (nor its
  cached_tokens), and the owner's next turn keeps its cached tokens;
- within a tenant, a request that diverges from the session its header names forks a new session;
- idle sessions past the grace are evicted, least recently used first, when the deployment refuses a
  new session for lack of KV (the attack: sessions of long prompts and max_tokens 1 fill the KV);
- a tenant's caps evict its own idle sessions, else 429 with Retry-After;
- no Redis key of the front outlives its sessions.

Then, on the torch engine: a conversation whose session was evicted goes on (a prefill of its whole
history) with exactly the greedy tokens of an undisturbed one.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ampd import perf
from ampd.front.index import SessionIndex
from ampd.launcher import Deployment, Options
from ampd.state import connect
from tests.integration.fronts import extra_front, tiny_chat_llama

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
NS = "front-hostile"
KV_TOKENS = 4096
TENANTS = ("t1a", "t1b", "t2a", "t2b", "t3", "caps", "fill0", "fill1", "fill2", "fill3", "chat", "leak-a", "leak-b", "ref", "live")
KEYS = {t: f"key-of-{t}-0123456789abcdef" for t in TENANTS}


def _profile(tmp_path: Path, kv_tokens: int, step_s: float) -> str:
    """zero@none with a KV pool of ``kv_tokens`` and decode steps of ``step_s`` at TP 1."""
    d = json.loads((Path(perf.__file__).parent / "profiles" / "zero@none.json").read_text())
    d["name"] = "fronthostile@test"
    t1 = d["tp"]["1"]
    t1["kv_capacity_tokens"] = kv_tokens
    t1["t_dec"]["batch"]["alpha"] = [step_s] * len(t1["t_dec"]["batch"]["alpha"])
    path = tmp_path / "fronthostile@test.json"
    path.write_text(json.dumps(d))
    return str(path)


def _keys_file(tmp_path: Path) -> str:
    path = tmp_path / "api-keys"
    path.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    return str(path)


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front-hostile")
    opts = Options(prefill="none", decode="tp1*1", profile=_profile(tmp, KV_TOKENS, 0.01), policy="local",
                   redis_url=redis_url, namespace=NS, session_ttl=120.0, admission_wait=0.5, idle_grace=1.0,
                   api_keys=_keys_file(tmp), tenant_sessions=2, tenant_kv_tokens=1500, run_dir=str(tmp / "run"))
    with Deployment(opts, frontend=True) as d:
        d.keys_file = opts.frontend.api_keys
        yield d


def post(url: str, body: dict, tenant: str | None, path: str = "/v1/chat/completions",
         headers: dict | None = None) -> tuple[int, dict, dict]:
    h = {"content-type": "application/json", **(headers or {})}
    if tenant is not None:
        h["authorization"] = f"Bearer {KEYS.get(tenant, tenant)}"
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def chat(messages: list[dict], max_tokens: int = 4, **kw) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **kw}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), 0.0)


def test_a_missing_or_wrong_key_gets_401(dep):
    for tenant in (None, "not-a-key-0123456789", KEYS["t1a"] + "x"):
        s, b, _ = post(dep.frontend, chat([user("hi")]), tenant)
        assert s == 401 and b["error"]["code"] == "invalid_api_key"


def test_another_tenant_resending_a_conversation_gets_a_session_of_its_own(dep):
    """The attack: t1b resends t1a's conversation (a guess of its next message included). It gets a
    new session and 0 cached tokens (nothing confirms the guess); t1a's next turn keeps its cache."""
    url = dep.frontend
    convo = [user("my secret plan is to buy the company")]
    s1, b1, _ = post(url, chat(convo), "t1a")
    assert s1 == 200
    convo2 = convo + [b1["choices"][0]["message"], user("and then?")]
    s2, b2, _ = post(url, chat(convo2), "t1b")  # another tenant, the same conversation
    assert s2 == 200 and cached(b2) == 0 and b2["ampd"]["session_id"] != b1["ampd"]["session_id"]
    s3, b3, _ = post(url, chat(convo2), "t1a")  # the owner's next turn: its session, its cache
    assert s3 == 200 and b3["ampd"]["session_id"] == b1["ampd"]["session_id"]
    assert cached(b3) == b1["usage"]["prompt_tokens"] + 4 - 1


def test_another_tenants_session_id_never_reaches_the_session(dep):
    """The attack: t2b names t2a's session in x-session-id with a diverging conversation. It gets a
    session of its own (0 cached tokens: no common prefix reported), and t2a's KV is untouched."""
    url = dep.frontend
    h = {"x-session-id": "victim-1"}
    convo = [user("the launch code is 1234")]
    s1, b1, _ = post(url, chat(convo), "t2a", headers=h)
    assert s1 == 200 and b1["ampd"]["session_id"] == "victim-1"
    for probe in ("the launch code is 9", "the launch code is 1234"):
        s, b, hdr = post(url, chat([user(probe), {"role": "assistant", "content": "x"}, user("?")]), "t2b", headers=h)
        assert s == 200 and cached(b) == 0, b
        assert b["ampd"]["l_hist"] == 0
    s2, b2, _ = post(url, chat(convo + [b1["choices"][0]["message"], user("next")]), "t2a", headers=h)
    assert s2 == 200 and b2["ampd"]["session_id"] == "victim-1"
    assert cached(b2) == b1["usage"]["prompt_tokens"] + 4 - 1  # not truncated


def test_a_diverging_request_forks_and_the_named_session_keeps_its_cache(dep):
    url = dep.frontend
    h = {"x-session-id": "mine"}
    convo = [user("tell me about tides")]
    s1, b1, _ = post(url, chat(convo), "t3", headers=h)
    assert s1 == 200
    forks_before = metric(url, "ampd_frontend_session_turns_total", how="fork")
    edited = [user("tell me about waves"), b1["choices"][0]["message"], user("more")]
    s2, b2, hdr = post(url, chat(edited), "t3", headers=h)
    assert s2 == 200 and cached(b2) == 0
    assert hdr["x-session-id"] != "mine" and b2["ampd"]["session_id"] == hdr["x-session-id"]  # a new session
    assert metric(url, "ampd_frontend_session_turns_total", how="fork") == forks_before + 1
    s3, b3, _ = post(url, chat(convo + [b1["choices"][0]["message"], user("more")]), "t3", headers=h)
    assert s3 == 200 and b3["ampd"]["session_id"] == "mine"
    assert cached(b3) == b1["usage"]["prompt_tokens"] + 4 - 1


def _stream(url: str, body: dict, tenant: str) -> int:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json",
                                          "authorization": f"Bearer {KEYS[tenant]}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
        return r.status


def test_a_tenant_at_its_caps_loses_its_own_idle_sessions_else_gets_429(dep):
    url = dep.frontend
    before = metric(url, "ampd_frontend_sessions_evicted", reason="tenant-sessions")
    firsts = []
    for i in range(3):  # the cap is 2: the third conversation evicts the first (the LRU idle one)
        s, b, _ = post(url, chat([user(f"conversation {i}")]), "caps")
        assert s == 200
        firsts.append(b)
    assert metric(url, "ampd_frontend_sessions_evicted", reason="tenant-sessions") == before + 1
    # the first comes back as a new session (0 cached tokens); the second is still held (cached)
    s, b, _ = post(url, chat([user("conversation 1"), firsts[1]["choices"][0]["message"], user("go on")]), "caps")
    assert s == 200 and cached(b) > 0
    # two long turns busy: a third conversation finds nothing to evict
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda i=i: statuses.append(_stream(
        url, chat([user(f"busy {i}")], max_tokens=500, ignore_eos=True), "caps")), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())["sessions"] < 1 or \
            metric(url, "ampd_frontend_sessions_active", state="busy") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    s, b, hdr = post(url, chat([user("one too many")]), "caps")
    assert s == 429 and b["error"]["code"] == "tenant_limit" and int(hdr["retry-after"]) >= 1
    for t in threads:
        t.join(60)
    assert statuses == [200, 200]
    # a conversation over the tenant's KV cap alone is a permanent error naming it
    s, b, _ = post(url, {"model": MODEL, "prompt": list(range(100, 1700)), "max_tokens": 1}, "caps",
                   "/v1/completions")
    assert s == 400 and b["error"]["param"] == "prompt" and "--tenant-kv-tokens" in b["error"]["message"]


def test_idle_sessions_cannot_starve_a_new_one_of_kv(dep):
    """The attack, scaled down: completions of long prompts with max_tokens 1, each from its own
    tenant, hold more KV than the decode worker has; each new one and then a normal chat are served,
    the least recently used idle sessions evicted (counted), the newest kept."""
    url = dep.frontend
    before = metric(url, "ampd_frontend_sessions_evicted", reason="kv-full")
    prompts = []
    for i in range(4):  # 4 x (1100 + 1 + 32) > 4096: the fourth does not fit beside the first three
        prompt = list(range(1000 + i, 2100 + i))
        s, b, _ = post(url, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "return_token_ids": True},
                       f"fill{i}", "/v1/completions")
        assert s == 200, b
        prompts.append(prompt + b["choices"][0]["token_ids"])
    s, b, _ = post(url, chat([user("hello, is anyone there?")]), "chat")
    assert s == 200, b
    assert metric(url, "ampd_frontend_sessions_evicted", reason="kv-full") > before
    # the newest filler was not evicted: its next turn reuses its KV; the oldest was, and comes back
    # without its session's KV: at most its prompt's full blocks, which prefix sharing keeps cached
    # while the pool has room (with the host KV tier, on by default, idle KV moves to host and leaves
    # that room; without it they are reclaimed: 0)
    s, b, _ = post(url, {"model": MODEL, "prompt": prompts[3] + [7, 8], "max_tokens": 1}, "fill3", "/v1/completions")
    assert s == 200 and cached(b) == len(prompts[3]) - 1
    s, b, _ = post(url, {"model": MODEL, "prompt": prompts[0] + [7, 8], "max_tokens": 1}, "fill0", "/v1/completions")
    assert s == 200 and b["usage"]["prompt_tokens"] == len(prompts[0]) + 2
    assert cached(b) in (0, (len(prompts[0]) - 1) // 32 * 32), cached(b)  # (32-token blocks)


def test_no_front_key_outlives_its_sessions(dep, tmp_path):
    """A second front (its own namespace, a short TTL, room for one session: every new conversation
    evicts the other) serves conversations of two tenants with forks and evictions; once its
    sessions are past their TTL, it holds no Redis key."""
    ns, ttl = "front-leak", 2.0
    with extra_front(dep.coordinator, dep.redis_url, tmp_path / "front.port", "--namespace", ns, "--api-keys",
                     dep.keys_file, "--session-ttl", str(ttl), "--max-sessions", "1") as url:
        for tenant in ("leak-a", "leak-b"):
            convo = [user(f"{tenant} says hi")]
            for turn in range(3):
                s, b, _ = post(url, chat(convo), tenant, headers={"x-session-id": "named"} if turn == 1 else None)
                assert s == 200, b
                convo += [b["choices"][0]["message"], user(f"turn {turn}")]
        assert metric(url, "ampd_frontend_sessions_evicted", reason="max-sessions") >= 1

        async def keys():
            r = await connect(dep.redis_url)
            try:
                return await SessionIndex(r, ns, ttl).keys()
            finally:
                await r.aclose()

        assert asyncio.run(keys())  # the sessions' keys, while they live
        deadline = time.monotonic() + 30
        while (left := asyncio.run(keys())) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == []


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory):
    return tiny_chat_llama(tmp_path_factory.mktemp("chat-llama"))


async def _answer_known(redis_url: str, ns: str, tenant: str, message: dict) -> bool:
    from ampd.chat.conversation import answer_digest
    from ampd.front.index import tenant_scope

    r = await connect(redis_url)
    try:
        d = answer_digest(message.get("content"), message.get("tool_calls"))
        return bool((await SessionIndex(r, ns, 1.0).prefetch(tenant_scope(tenant), [d]))[1])
    finally:
        await r.aclose()


def test_torch_an_evicted_conversation_goes_on_with_the_undisturbed_greedy_tokens(chat_llama, redis_url, tmp_path):
    """KV for 1,024 tokens, conversations of ~330: `ref` runs a conversation undisturbed; `live` runs
    the same one, and two more whose opens evict it (and `ref`'s); its next turn prefills its whole
    history in a new session and answers exactly what `ref`'s second turn did."""
    opts = Options(prefill="none", decode="tp1*1", engine="torch", model=str(chat_llama), policy="local",
                   profile=_profile(tmp_path, 1024, 0.0), ttft_slo=5.0, itl_slo=1.0, redis_url=redis_url,
                   namespace="front-hostile-torch", session_ttl=120.0, admission_wait=0.5, idle_grace=0.5,
                   api_keys=_keys_file(tmp_path), run_dir=str(tmp_path / "run"))
    model = str(chat_llama)

    def turn(url: str, tenant: str, messages: list[dict]) -> dict:
        s, b, _ = post(url, {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True}, tenant)
        assert s == 200, b
        return b

    first = [user("alpha " * 300)]
    with Deployment(opts, frontend=True) as dep:
        url = dep.frontend
        r1 = turn(url, "ref", first)
        second = first + [r1["choices"][0]["message"], user("next question please")]
        r2 = turn(url, "ref", second)
        assert cached(r2) > 0  # undisturbed: its session's KV
        l1 = turn(url, "live", first)
        assert l1["choices"][0]["message"] == r1["choices"][0]["message"]
        turn(url, "live", [user("beta " * 300)])  # evicts ref's session
        turn(url, "live", [user("gamma " * 300)])  # evicts the live conversation's
        # the evicted session's answer keeps its ids (re-tokenizing its text may give others)
        msg = l1["choices"][0]["message"]
        assert asyncio.run(_answer_known(redis_url, "front-hostile-torch", "live", msg))
        l2 = turn(url, "live", second)
        assert metric(url, "ampd_frontend_sessions_evicted", reason="kv-full") >= 3
    assert l2["usage"]["prompt_tokens"] == r2["usage"]["prompt_tokens"]
    assert l2["choices"][0]["message"] == r2["choices"][0]["message"]
    # Its history is prefilled again, but for (with --prefix-sharing) the whole blocks of its first
    # prompt that its own evicted session left cached in its tenant's prefix scope (docs/kv.md)
    assert cached(l2) <= (l1["usage"]["prompt_tokens"] if opts.policy.prefix_sharing else 0)
