"""A chat session against a deployment's coordinators: text in, each round's text and timings out.

`ChatSession` keeps one `Coordinator/Session` stream open (through ``ampd.coordinators``: given
several coordinators, a session whose coordinator is lost goes on through another) and sends the
conversation one user message at a time. The first turn carries the whole rendered conversation (system prompt, tools,
earlier messages); every later turn carries only the template's continuation after the previous
round (`ChatFormat.continuation_ids`): the session's KV already holds the rest. A turn comes back as
its rounds: one per model output, where a server-side tool call's result was the next round's input
on the decode worker (the client never sees it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import grpc

from ampd.coordinators import Coordinators, parse_addresses, session_events
from ampd.chat.template import ChatFormat
from ampd.v1 import common_pb2, coordinator_pb2

__all__ = ["ChatRound", "ChatSession", "ChatError"]


class ChatError(Exception):
    """The session ended with an error (the coordinator's status, or a stream that ended early)."""


@dataclass
class ChatRound:
    round: int
    token_ids: list[int] = field(default_factory=list)
    timing: common_pb2.RoundTiming | None = None
    tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)
    text: str = ""  # the output as text, without the end-of-turn token

    @property
    def ttft_s(self) -> float:
        return self.timing.first_token - self.timing.input_ready

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency (None for a one-token round)."""
        t = self.timing
        return (t.last_token - t.first_token) / (t.tokens - 1) if t.tokens > 1 else None

    @property
    def placement(self) -> str:
        return "local" if self.timing.local else "remote"


class ChatSession:
    """One conversation. Use `async with`; `send(message)` answers one user message. ``address``:
    the coordinators', ``HOST:PORT[,HOST:PORT...]``."""

    def __init__(self, address: str, fmt: ChatFormat, session_id: str, *, max_tokens: int,
                 server_tools: Sequence[str] = (), tools: Sequence[Mapping] = (),
                 history: Sequence[Mapping[str, Any]] = (), timeout_s: float = 1800.0) -> None:
        self.address, self.fmt, self.session_id = address, fmt, session_id
        self.max_tokens, self.server_tools, self.tools = max_tokens, list(server_tools), list(tools)
        self.history = list(history)  # messages before the first user message (system, examples)
        self.timeout_s = timeout_s
        self.opened = False
        self.last_token: int | None = None  # the session's last output token
        self._coords: Coordinators | None = None
        self._outbox: asyncio.Queue = asyncio.Queue()  # the messages to send; None half-closes
        self._call = None
        self._events = None

    async def __aenter__(self) -> "ChatSession":
        self._coords = Coordinators(parse_addresses(self.address, "--coordinator-address"))
        try:
            await self._coords.check()  # one that does not answer: named now, not a stream error later
        except ConnectionError:
            await self._coords.close()
            raise
        self._call = self._coords.Session(self._requests(), timeout=self.timeout_s)
        self._events = session_events(self._call).__aiter__()
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if self.opened and exc[0] is None:
                self._outbox.put_nowait(coordinator_pb2.ClientMessage(close=coordinator_pb2.Close()))
                self._outbox.put_nowait(None)
                async for _ in self._read_until("done"):
                    pass
        finally:
            self._call.cancel()
            await self._coords.close()

    async def _requests(self):
        while (m := await self._outbox.get()) is not None:
            yield m

    def input_ids(self, message: Mapping[str, Any]) -> list[int]:
        """What the next turn prefills: the whole conversation first, then the continuation."""
        if not self.opened:
            return self.fmt.render([*self.history, message], self.tools or None)
        after_eos = self.last_token == self.fmt.tokenizer.eos_token_id
        return self.fmt.continuation_ids([message], after_eos=after_eos)

    async def send(self, content: str) -> list[ChatRound]:
        """Sends one user message; returns the rounds that answered it."""
        ids = self.input_ids({"role": "user", "content": content})
        turn = common_pb2.Turn(token_ids=ids, sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens),
                               server_tools=self.server_tools)
        if self.opened:
            msg = coordinator_pb2.ClientMessage(turn=turn)
        else:
            msg = coordinator_pb2.ClientMessage(open=common_pb2.OpenSession(session_id=self.session_id, turn=turn))
        self._outbox.put_nowait(msg)
        self.opened = True
        rounds: dict[int, ChatRound] = {}
        async for ev in self._read_until("turn_end"):
            kind = ev.WhichOneof("event")
            if kind == "tokens":
                r = rounds.setdefault(ev.tokens.round, ChatRound(ev.tokens.round))
                r.token_ids.extend(ev.tokens.token_ids)
            elif kind == "round_end":
                t = ev.round_end.timing
                rounds.setdefault(t.round, ChatRound(t.round)).timing = t
            elif kind == "tool_call":
                rounds.setdefault(ev.tool_call.round, ChatRound(ev.tool_call.round)).tool_calls.append(ev.tool_call)
        out = [rounds[k] for k in sorted(rounds)]
        for r in out:
            r.text = self.text(r.token_ids)
        if out and out[-1].token_ids:
            self.last_token = out[-1].token_ids[-1]
        return out

    def text(self, ids: Sequence[int]) -> str:
        """An output's text; the end-of-turn token that ends it is no part of it."""
        if ids and ids[-1] == self.fmt.tokenizer.eos_token_id:
            ids = ids[:-1]
        return self.fmt.tokenizer.decode(list(ids), skip_special_tokens=False)

    async def _read_until(self, last: str):
        """The session's events up to and including the first of kind `last`."""
        while True:
            try:
                ev = await anext(self._events)
            except grpc.aio.AioRpcError as exc:
                raise ChatError(f"{exc.code().name}: {exc.details()}") from None
            except StopAsyncIteration:
                raise ChatError(f"the session's stream ended before its {last}") from None
            yield ev
            if ev.WhichOneof("event") == last:
                return
