"""From an HTTP request to what its turn needs: the tenant its API key names, the body (bounded,
parsed, rendered and tokenized off the event loop), the session header, the sampling parameters and
the answer's stop rules."""
from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import orjson
from starlette.requests import Request

from ampd.chat.conversation import answer_digest, render_conversation
from ampd.chat.template import ChatFormat
from ampd.engine import capabilities_of
from ampd.front.answer import FORCED_STOP, Answer, forced_prefix
from ampd.front.api import ApiError, ChatRequest, RequestLimits, Sampling, check_depth, parse_chat
from ampd.front.tenants import KeyRing, Tenant, load_api_keys
from ampd.validate import MAX_ID as MAX_SESSION_ID
from ampd.v1 import common_pb2

# Session headers, in the order they are read: ours, then llm-d's session-affinity header.
SESSION_HEADERS = ("x-session-id", "x-session-token")
MAX_BODY = 32 << 20  # bytes of one request body
# Threads that parse, template and tokenize request bodies, off the event loop (a 10 MB message
# tokenized on the loop held /health for 8 s, issue 24). Bounded: a burst queues here instead of
# growing threads; the tokenizer is shared, read only (same padding and truncation on every call).
WORK_THREADS = 4


def too_large() -> ApiError:
    return ApiError(413, f"body: over {MAX_BODY} bytes", code="body_too_large")


class RequestReader:
    """Reads requests for the front: the served model, the API keys, the request limits, the chat
    format and the work threads (``work``, shut down with the front)."""

    def __init__(self, args: argparse.Namespace, fmt: ChatFormat) -> None:
        self.model = args.model
        self.engine = args.engine
        self.default_max_tokens = args.default_max_tokens
        # API keys name tenants; else the shared token is one tenant; else the front is open
        self.keys = KeyRing(load_api_keys(args.api_keys) if args.api_keys else None, args.auth_token)
        self.fmt = fmt
        self.tok = fmt.tokenizer
        self.eos_ids = (self.tok.eos_token_id,) if self.tok.eos_token_id is not None else ()
        self.limits = RequestLimits(args.max_messages, args.max_prompt_chars)
        self.work = ThreadPoolExecutor(WORK_THREADS, thread_name_prefix="front-work")

    def detok(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def tenant(self, request: Request) -> Tenant:
        """The request's tenant (request.state.tenant), or 401."""
        tenant = self.keys.tenant(request.headers.get("authorization", ""))
        if tenant is None:
            raise ApiError(401, "authorization: missing or wrong API key (Authorization: Bearer KEY)",
                           code="invalid_api_key", type="authentication_error")
        request.state.tenant = tenant
        return tenant

    def check_model(self, model: str) -> None:
        if model != self.model:
            raise ApiError(404, f"model: {model!r} is not served here (served: {self.model!r})", param="model",
                           code="model_not_found")

    async def body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to pass MAX_BODY: by its Content-Length before
        any of it is read, or while a chunked one streams in, without buffering more."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
            raise too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise too_large()
            chunks.append(chunk)
        raw = b"".join(chunks)
        request.state.raw = raw
        return raw

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.work, fn, *args)

    def parse(self, raw: bytes, parse) -> Any:
        """Runs in the work pool: decoding, the nesting check (before anything walks the body
        recursively) and the field checks of a body that may be 32 MiB."""
        try:
            body = orjson.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"body: malformed JSON ({exc})", code="malformed_json") from None
        check_depth(body)
        return parse(body, self.limits)

    def parse_chat(self, raw: bytes) -> tuple[ChatRequest, list[str]]:
        req = self.parse(raw, parse_chat)
        return req, [answer_digest(m.get("content"), m.get("tool_calls")) for m in req.messages
                     if m.get("role") == "assistant"]

    def render(self, req: ChatRequest, known: dict) -> tuple[list[int], list[int]]:
        """Runs in the work pool: the conversation's ids and the forced call's prefix."""
        try:
            rendered = render_conversation(self.fmt, req.messages, req.tools or None, known.get)
        except ValueError as exc:
            param = str(exc).split(":", 1)[0]
            raise ApiError(400, str(exc), param=param if param.startswith("messages") else "messages") from None
        prefix = self.fmt.encode(forced_prefix(req.forced_tool)) if req.forced_tool else []
        return rendered.ids + prefix, prefix

    @staticmethod
    def session_header(request: Request) -> str:
        for h in SESSION_HEADERS:
            v = request.headers.get(h)
            if v:
                if len(v) > MAX_SESSION_ID or not v.isprintable():
                    raise ApiError(400, f"{h}: at most {MAX_SESSION_ID} printable characters", param=h)
                return v
        return ""

    def sampling(self, s: Sampling, forced: bool) -> common_pb2.SamplingParams:
        stop = list(s.stop)
        if forced and capabilities_of(self.engine).text_output:  # the mock's decode worker has no text to find it in
            stop.append(FORCED_STOP)
        p = common_pb2.SamplingParams(max_tokens=s.max_tokens or self.default_max_tokens, temperature=s.temperature,
                                      top_p=s.top_p, stop=stop, stop_token_ids=s.stop_token_ids,
                                      ignore_eos=s.ignore_eos)
        if s.seed is not None:
            p.seed = s.seed
        return p

    def answer(self, p: common_pb2.SamplingParams, forced: str | None, hold: bool) -> Answer:
        return Answer(p.max_tokens, self.detok, self.eos_ids, tuple(p.stop_token_ids), tuple(p.stop), p.ignore_eos,
                      forced, hold)
