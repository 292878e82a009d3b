"""A client that goes away mid-answer (issue 24, finding 10): the front stops its round's decoding
(StopRound) instead of generating the whole output for nobody, and records the history the session
then holds, so the session serves the conversation's next request (cached tokens, same session).

One mock-engine deployment with a slow decode profile: an answer of LONG tokens would take minutes,
so a round that is not stopped keeps its session busy far past the bound here. The clients are raw
sockets, closed at a chosen moment."""
from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ampd.front.index import SessionIndex
from ampd.launcher import Deployment, Options
from ampd.state import connect
from tests.integration.rpc_metrics import worker_metrics

pytestmark = pytest.mark.timeout(240)

MODEL = "smollm2-135m-instruct"
NS = "front-disconnect"
LONG = 20_000  # max_tokens of an answer whose client goes away: minutes on the profile's decode steps
IDLE_S = 10.0  # the stopped round's session is idle again within this (its full answer: minutes)
SHORT = 24  # max_tokens of the answers that run to their end


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    opts = Options(prefill="1", decode="1", profile="qwen3-32b@h20", redis_url=redis_url, namespace=NS,
                   session_ttl=120.0, run_dir=str(tmp_path_factory.mktemp("run")))
    with Deployment(opts, frontend=True) as d:
        yield d


# ----------------------------------------------------------------------------------------- clients
def _send(url: str, path: str, body: dict) -> socket.socket:
    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {u.hostname}\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _first_chunk(sock: socket.socket) -> dict[str, str]:
    """Reads the response's head and its first SSE event; the response's headers."""
    buf = b""
    while b"\r\n\r\n" not in buf or b"\n\n" not in buf.split(b"\r\n\r\n", 1)[1].split(b"data: ", 1)[-1]:
        got = sock.recv(65536)
        assert got, f"the connection closed early: {buf[:300]!r}"
        buf += got
    head = buf.split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith("HTTP/1.1 200"), head
    return {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head.split("\r\n")[1:])}


def post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
        if raw.startswith("data:"):
            events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
            return r.status, {"events": events, "done": raw.rstrip().endswith("data: [DONE]")}, dict(r.headers)
        return r.status, json.loads(raw), dict(r.headers)


# ----------------------------------------------------------------------------------------- probes
def front_metric(dep, name: str, **labels) -> float:
    text = urllib.request.urlopen(dep.frontend + "/metrics", timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def decode_tokens(dep) -> float:
    """Output tokens the decode worker has made so far."""
    (values,) = [v for kind, v in asyncio.run(worker_metrics(dep.redis_url, NS)).values() if kind == "decode"]
    return values["tokens"]


def until_idle(dep, timeout_s: float = IDLE_S) -> float:
    """Seconds until the front holds no busy session (its turns ended); fails past ``timeout_s``."""
    t0 = time.monotonic()
    while front_metric(dep, "ampd_frontend_sessions_active", state="busy") > 0:
        assert time.monotonic() - t0 < timeout_s, f"a session is still busy after {timeout_s} s: its round ran on"
        time.sleep(0.05)
    return time.monotonic() - t0


def recorded_history(dep, sid: str) -> list[int]:
    async def read():
        r = await connect(dep.redis_url)
        try:
            return await SessionIndex(r, NS, 120.0).history(sid)
        finally:
            await r.aclose()
    history = asyncio.run(read())
    assert history, f"session {sid} has no record"
    return history


def stopped_answer(dep, sid: str, before: float, prompt_len: int) -> list[int]:
    """After its client went away: the round stopped at once, far short of LONG, the decode worker
    makes no more tokens for it, and the front recorded the history the session holds; that history."""
    took = until_idle(dep)
    made = decode_tokens(dep) - before
    time.sleep(0.3)
    assert decode_tokens(dep) - before == made, "the decode worker still makes tokens for the gone client"
    history = recorded_history(dep, sid)
    out = len(history) - prompt_len
    assert 1 <= out < LONG // 20, (out, took)
    assert made == out, "the front records every token the session made (and none it did not)"
    return history


def continues(dep, sid: str, history: list[int]) -> None:
    """The conversation's next request (the session's history, then new tokens) continues the
    session: answered in full, the same session, every history token cached but the last output."""
    status, body, headers = post(dep.frontend, "/v1/completions",
                                 {"model": MODEL, "prompt": history + [11, 12, 13], "max_tokens": SHORT,
                                  "ignore_eos": True})
    assert status == 200
    assert headers["x-session-id"] == sid
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1
    assert body["usage"]["completion_tokens"] == SHORT and body["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------------ tests
def test_a_streaming_chat_client_that_goes_away_stops_its_round_and_the_session_goes_on(dep):
    until_idle(dep)
    stopped = front_metric(dep, "ampd_frontend_turns_stopped_total")
    before = decode_tokens(dep)
    messages = [{"role": "user", "content": "tell me a very long story"}]
    sock = _send(dep.frontend, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": LONG,
                                                        "ignore_eos": True, "stream": True})
    sid = _first_chunk(sock)["x-session-id"]
    sock.close()
    history = stopped_answer(dep, sid, before, _chat_prompt_len(dep, messages))
    assert front_metric(dep, "ampd_frontend_turns_stopped_total") == stopped + 1
    continues(dep, sid, history)
    # the same conversation sent again without the answer its client never got: answered in full
    status, body, _ = post(dep.frontend, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                  "max_tokens": SHORT, "ignore_eos": True},
                           headers={"x-session-id": sid})
    assert status == 200 and body["usage"]["completion_tokens"] == SHORT


def test_a_streaming_completion_client_that_goes_away_stops_its_round(dep):
    until_idle(dep)
    before = decode_tokens(dep)
    prompt = list(range(100, 400))
    sock = _send(dep.frontend, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": LONG,
                                                   "ignore_eos": True, "stream": True, "return_token_ids": True})
    sid = _first_chunk(sock)["x-session-id"]
    sock.close()
    history = stopped_answer(dep, sid, before, len(prompt))
    assert history[:len(prompt)] == prompt
    continues(dep, sid, history)


def test_a_client_that_goes_away_while_waiting_for_a_whole_answer_stops_its_round(dep):
    until_idle(dep)
    before = decode_tokens(dep)
    prompt = list(range(500, 700))
    sock = _send(dep.frontend, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": LONG,
                                                   "ignore_eos": True})
    deadline = time.monotonic() + 30
    while decode_tokens(dep) - before < 5:  # its round runs
        assert time.monotonic() < deadline, "the round did not start"
        time.sleep(0.05)
    sock.close()
    sid = _only_new_session(dep, prompt)
    history = stopped_answer(dep, sid, before, len(prompt))
    continues(dep, sid, history)


def test_clients_that_stay_get_their_whole_answer(dep):
    until_idle(dep)
    stopped = front_metric(dep, "ampd_frontend_turns_stopped_total")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": SHORT,
            "ignore_eos": True}
    status, streamed, _ = post(dep.frontend, "/v1/chat/completions",
                               {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and streamed["done"]
    assert streamed["events"][-1]["usage"]["completion_tokens"] == SHORT
    assert [e["choices"][0]["finish_reason"] for e in streamed["events"] if e["choices"]][-1] == "length"
    status, whole, _ = post(dep.frontend, "/v1/completions", {"model": MODEL, "prompt": list(range(900, 950)),
                                                              "max_tokens": SHORT, "ignore_eos": True})
    assert status == 200 and whole["usage"]["completion_tokens"] == SHORT
    assert whole["choices"][0]["finish_reason"] == "length"
    assert front_metric(dep, "ampd_frontend_turns_stopped_total") == stopped


# ---------------------------------------------------------------------------------------- helpers
def _chat_prompt_len(dep, messages: list[dict]) -> int:
    from ampd.chat.template import ChatFormat
    from ampd.chat.tokenizer import tokenizer_for

    return len(ChatFormat(tokenizer_for("mock", MODEL)).render(messages, None))


def _only_new_session(dep, prompt: list[int]) -> str:
    """The session a non-streaming request opened (its client never saw the response's header):
    the one whose record starts with ``prompt``, once its turn ended."""
    async def find():
        r = await connect(dep.redis_url)
        try:
            index = SessionIndex(r, NS, 120.0)
            deadline = time.monotonic() + IDLE_S
            while time.monotonic() < deadline:
                for sid in await index.live_sessions():
                    h = await index.history(sid)
                    if h and h[:len(prompt)] == prompt:
                        return sid
                await asyncio.sleep(0.05)
            raise AssertionError("no session recorded for the request: its round ran on")
        finally:
            await r.aclose()
    return asyncio.run(find())
