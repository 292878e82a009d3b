"""The front against hostile requests (issue 24), on one mock-engine deployment: each attack of the
adversarial pass, scaled down, gets a clear 4xx (or a retryable 429/503) naming the field or limit,
`/health` answers within 1 s while it runs (polled from another thread throughout), the front
serves a normal chat right after, and no log line of the run carries a request's payload."""
from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import httpx2
import pytest

from ampd.front.api import MAX_JSON_DEPTH
from ampd.launcher import Deployment, Options
from services.frontend.server import MAX_BODY

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
MARKER = "zq7MARKERpayload"  # in every prompt and argument below: no log line may carry it
INFLIGHT = 200  # --max-inflight-requests here: a burst of BURST is partly refused
BURST = 300
MAX_CHARS = 1_000_000  # --max-prompt-chars here
MAX_MESSAGES = 1000
HEALTH_S = 1.0
KV_POOL_MB = 4  # 64 Ki tokens of mock KV (64 bytes each): a prompt under MAX_CHARS may still not fit


@pytest.fixture(scope="module")
def dep(redis_url, tmp_path_factory):
    opts = Options(prefill="tp1*1", decode="tp1*1", profile="zero@none", policy="ampd", redis_url=redis_url,
                   namespace="front-hostile", session_ttl=5.0, run_dir=str(tmp_path_factory.mktemp("run")),
                   max_inflight_requests=INFLIGHT, max_prompt_chars=MAX_CHARS, max_messages=MAX_MESSAGES,
                   kv_pool_mb=KV_POOL_MB)
    with Deployment(opts, frontend=True) as d:
        yield d


class HealthProbe:
    """Polls /health from its own thread (the test's event loop must not delay the probe) and keeps
    the slowest answer; a probe that fails or times out counts as its timeout."""

    def __init__(self, url: str, every_s: float = 0.05, timeout_s: float = 5.0) -> None:
        self.url, self.every_s, self.timeout_s = url + "/health", every_s, timeout_s
        self.worst = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx2.Client(timeout=self.timeout_s) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.get(self.url).status_code == 200
                except httpx2.HTTPError:
                    ok = False
                took = time.monotonic() - t0 if ok else self.timeout_s
                self.worst, self.count = max(self.worst, took), self.count + 1
                self._first.set()
                self._stop.wait(self.every_s)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        self._first.wait(self.timeout_s)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is not None:
            return
        assert self.count > 0
        assert self.worst < HEALTH_S, f"/health took {self.worst:.2f} s during the attack"


def post(url: str, body, path: str = "/v1/chat/completions", timeout: float = 60) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def chat(content: str = f"hello {MARKER}", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def _error(got: tuple[int, dict, dict], status: int, param, code=None) -> dict:
    s, body, _ = got
    assert s == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def _serves(url: str, within_s: float = 5.0) -> float:
    """Seconds until the front answers a normal chat with 200 (retrying a refusal)."""
    t0 = time.monotonic()
    while True:
        s, body, _ = post(url, chat(), timeout=within_s)
        if s == 200:
            return time.monotonic() - t0
        assert s in (429, 503), body
        assert time.monotonic() - t0 < within_s, body
        time.sleep(0.1)


def _nested(depth: int) -> dict:
    node: dict = {"type": "string", "description": MARKER}
    for _ in range(depth - 1):
        node = {"type": "object", "properties": {"a": node}}
    return node


def _deep_tool(depth: int) -> bytes:
    """A chat whose tool's `parameters` nest ``depth`` objects deep (each level two JSON objects),
    written as text: JSON encoders recurse and stop far short of it."""
    schema = ('{"type": "object", "properties": {"a": ' * (depth - 1) + f'{{"type": "string", "description": '
              f'"{MARKER}"}}' + "}}" * (depth - 1))
    body = json.dumps(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "SCHEMA"}}]))
    return body.replace('"SCHEMA"', schema).encode()


# ---------------------------------------------------------------------------- finding 1
def test_deep_nesting_is_a_400_naming_the_depth_and_the_field(dep):
    url = dep.frontend
    with HealthProbe(url):
        t0 = time.monotonic()
        # 1,000 levels of `properties` (the adversary's tool): each level is two JSON objects
        err = _error(post(url, _deep_tool(500)), 400, "tools", "nesting_too_deep")
        assert time.monotonic() - t0 < 5
        assert f"deeper than {MAX_JSON_DEPTH} levels" in err["message"]
        assert "tools[0].function.parameters.properties.a" in err["message"]
        assert MARKER not in err["message"]
        _error(post(url, chat(content=[{"type": "text", "text": MARKER, "x": _nested(MAX_JSON_DEPTH)}])),
               400, "messages", "nesting_too_deep")
        # deep beyond orjson's own limit: malformed, still a 400
        _error(post(url, b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"), 400, None,
               "malformed_json")
    # a real schema (a few levels) is served
    assert post(url, _deep_tool(8))[0] == 200
    _serves(url)


# ---------------------------------------------------------------------------- finding 6
def _raw_request(url: str, head: str) -> socket.socket:
    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=10)
    sock.sendall(head.encode())
    return sock


def _read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict]:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:"))
    while len(rest) < length:
        part = sock.recv(65536)
        if not part:
            break
        rest += part
    return status, json.loads(rest[:length])


def test_a_declared_oversized_body_is_refused_before_it_is_read(dep):
    host = urlsplit(dep.frontend).netloc
    sock = _raw_request(dep.frontend, f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                                      f"Content-Type: application/json\r\nContent-Length: {MAX_BODY * 40}\r\n\r\n")
    with sock:
        t0 = time.monotonic()
        status, body = _read_response(sock, 5)  # nothing of the body was sent
        assert (status, body["error"]["code"]) == (413, "body_too_large")
        assert time.monotonic() - t0 < 5


def _rmem_max() -> int:
    """The most a TCP receive buffer grows to on its own (tcp_rmem's third field)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_rmem") as f:
            return int(f.read().split()[2])
    except (OSError, IndexError, ValueError):
        return 6 << 20  # Linux's default maximum


def test_a_chunked_body_is_cut_at_the_limit_without_reading_on(dep):
    host = urlsplit(dep.frontend).netloc
    sock = _raw_request(dep.frontend, f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                                      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"[" + f'"{MARKER}",'.encode() * (1 << 16)  # ~1.2 MiB, a JSON text that never ends
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    # What the kernel may hold between the two ends once the front stops reading: the client's send
    # buffer and the front's receive buffer, which loopback autotuning grows up to tcp_rmem's maximum
    # (32 MiB on the CI machine). A front that reads on past the cut passes this bound.
    bound = MAX_BODY + sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + _rmem_max() + 2 * len(frame)
    sent, answered = 0, False
    with HealthProbe(dep.frontend), sock:
        try:
            while sent < bound:
                sock.sendall(frame)
                sent += len(chunk)
                if select.select([sock], [], [], 0)[0]:
                    answered = True
                    break
        except (BrokenPipeError, ConnectionResetError):
            answered = True  # the front closed the connection after its answer
        assert answered, f"the front read {sent} bytes of a body limited to {MAX_BODY}"
        try:
            status, body = _read_response(sock, 5)
        except (ConnectionResetError, StopIteration, IndexError):
            return  # the reset dropped the answer on the client's side; the cut is what matters
        assert (status, body["error"]["code"]) == (413, "body_too_large")
    _serves(dep.frontend)


# ---------------------------------------------------------------------------- finding 7
def test_big_prompts_are_refused_before_tokenizing_and_never_as_retryable(dep):
    url = dep.frontend
    with HealthProbe(url):
        t0 = time.monotonic()
        err = _error(post(url, chat(content=MARKER * (10_000_000 // len(MARKER)))), 400, "messages",
                     "context_length_exceeded")
        assert "--max-prompt-chars" in err["message"]
        many = {"model": MODEL, "messages": [{"role": "user", "content": MARKER}] * 100_000}
        _error(post(url, many), 400, "messages", "context_length_exceeded")
        assert time.monotonic() - t0 < 10
        # under the character limit, tokenized off the loop: more KV than the decode worker holds is
        # permanent (admission kv-size), a 400 that SDKs do not retry, not a 429
        s, body, _ = post(url, chat(content=(MARKER + " ") * ((MAX_CHARS - 100) // (len(MARKER) + 1))))
        assert s in (400, 413), body
        assert body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "messages"
        # token ids that do not fit the session API's 4 MiB message: 413, not 429
        s, body, _ = post(url, {"model": MODEL, "prompt": [4_000_000_000] * 1_000_000, "max_tokens": 2},
                          path="/v1/completions")
        assert s == 413 and body["error"]["param"] == "prompt", body
    _serves(url)


# ---------------------------------------------------------------------------- finding 9
def test_fields_beyond_the_wire_and_unsupported_parameters_are_named(dep):
    url = dep.frontend
    _error(post(url, chat(max_tokens=2147483648)), 400, "max_tokens")  # was a 500 ValueError
    _error(post(url, chat(seed=1 << 64)), 400, "seed")
    _error(post(url, chat(stop_token_ids=list(range(100)))), 400, "stop_token_ids")  # was param "stop"
    _error(post(url, chat(stop_token_ids=[1 << 32])), 400, "stop_token_ids[0]")
    _error(post(url, chat(stop=[MARKER * 20])), 400, "stop")
    _error(post(url, chat(temperature=MARKER)), 400, "temperature")
    for name, value in (("logprobs", True), ("top_logprobs", 2), ("response_format", {"type": "json_object"}),
                        ("n", 3), ("presence_penalty", 1.0)):
        err = _error(post(url, chat(**{name: value})), 400, name, "unsupported_parameter")
        assert "not supported" in err["message"]
    _error(post(url, {"model": MODEL, "prompt": MARKER, "echo": True}, path="/v1/completions"), 400, "echo",
           "unsupported_parameter")
    s, body, _ = post(url, chat(logprobs=False, n=1, response_format={"type": "text"}, top_logprobs=None))
    assert s == 200, body


# ---------------------------------------------------------------------------- finding 2
async def _burst(url: str, n: int, timeout_s: float) -> list[tuple[int, dict, str | None] | str]:
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(timeout=timeout_s, limits=limits) as c:
        async def one(i: int):
            try:
                r = await c.post(url + "/v1/chat/completions", json=chat(f"burst {i} {MARKER}"))
                return r.status_code, r.json(), r.headers.get("retry-after")
            except httpx2.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_burst_of_new_chats_is_served_or_refused_never_failed(dep):
    url = dep.frontend
    timeout_s = 60.0
    with HealthProbe(url) as probe:
        t0 = time.monotonic()
        out = asyncio.run(_burst(url, BURST, timeout_s))
        took = time.monotonic() - t0
        after = _serves(url)
    failed = [o for o in out if isinstance(o, str)]
    assert not failed, failed[:3]  # every request answered within its timeout
    statuses = [o[0] for o in out]
    assert all(s == 200 or s in (429, 503) for s in statuses), sorted(set(statuses))
    refused = [o for o in out if o[0] in (429, 503)]
    assert refused, "the burst was over --max-inflight-requests: some must be refused"
    for _, body, retry in refused:
        assert retry is not None and float(retry) >= 1
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert statuses.count(200) >= 1
    print(f"burst of {BURST}: {statuses.count(200)} served, {len(refused)} refused, {took:.1f} s; "
          f"a normal chat {after:.2f} s after; /health at worst {probe.worst * 1e3:.0f} ms")


# ---------------------------------------------------------------------------- logs
def test_no_log_line_of_the_attacks_carries_their_payload(dep):
    # runs after the others (file order): every attack above sent MARKER in prompts, tool schemas,
    # stop strings and bodies that failed; nothing of them may reach any service's log
    post(dep.frontend, chat(tools=[{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "description": MARKER}}}}}]))
    logs = sorted(dep.run_dir.glob("*.log"))
    assert any(p.name.startswith("frontend") for p in logs) and any(p.name.startswith("coordinator") for p in logs)
    for p in logs:
        text = p.read_text(errors="replace")
        assert MARKER not in text, f"{p.name} carries a request's payload"
