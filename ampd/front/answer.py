"""One turn's answer, built from the session's events, as OpenAI objects. Pure.

`Answer` takes the round's output tokens as they stream (its text is kept by a `StopChecker` with
the request's stop conditions, the rule the decode worker ends the round by), the tool calls the
decode worker parsed from the output, the round's timing (for `usage`) and the turn's end.

A forced call (`tool_choice` naming a function): the front opens the call in the prompt
(`forced_prefix`) and the model writes its arguments; they are what the model wrote, valid JSON or
not (OpenAI's documentation says the same of its own models' arguments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

from ampd.chat.stops import StopChecker
from ampd.chat.toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls

__all__ = ["Answer", "Call", "forced_prefix", "FORCED_STOP"]

FORCED_STOP = TOOL_CALL_CLOSE


def forced_prefix(name: str) -> str:
    """The text that opens a call of `name`; the model continues with the arguments."""
    return f"{TOOL_CALL_OPEN}\n{{\"name\": {json.dumps(name, ensure_ascii=False)}, \"arguments\": "


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str
    worker_call_id: str = ""  # the decode worker's id of a call it parsed (the next turn answers it)

    def openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class Answer:
    max_tokens: int
    detokenize: Callable[[Sequence[int]], str]
    eos_token_ids: Collection[int] = ()
    stop_token_ids: Collection[int] = ()
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    forced: str | None = None  # the function a forced call names
    hold_text: bool = False  # tools offered: the text may hold calls, so it goes out at the end

    tokens: list[int] = field(default_factory=list, init=False)
    worker_calls: list[Call] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    l_hist: int = field(default=0, init=False)
    l_incr: int = field(default=0, init=False)
    timing: Any = field(default=None, init=False)  # the round's RoundTiming

    def __post_init__(self) -> None:
        self.stops = StopChecker(self.max_tokens, self.detokenize, self.eos_token_ids, self.stop_token_ids,
                                 self.stop, self.ignore_eos)

    # --- events ---------------------------------------------------------------------------------
    def add(self, ids: Sequence[int]) -> None:
        """The round's next output tokens (their text is decoded when `text_delta` asks for it)."""
        self.tokens.extend(ids)

    def text_delta(self) -> str:
        """The text of the tokens added since the last call that may go out now: one decode for all
        of them (a stream that falls behind catches up in one chunk)."""
        new = self.tokens[len(self.stops.tokens):]
        if new and self.stops.finish_reason is None:
            self.stops.extend(new)
        if self.hold_text or self.forced:
            return ""
        return self.stops.delta()

    def tool_call(self, name: str, arguments: str, worker_call_id: str) -> None:
        self.worker_calls.append(Call(worker_call_id, name, arguments, worker_call_id))

    def round_end(self, timing: Any) -> None:
        if self.timing is None:  # the turn's first (and, at the front, only) round
            self.timing = timing
            self.l_hist, self.l_incr = timing.l_hist, timing.l_incr

    def turn_end(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason

    # --- the answer -----------------------------------------------------------------------------
    def calls(self) -> list[Call]:
        self.text_delta()  # every token's text is in (a no-op once it is)
        if self.forced is not None:
            text = self.stops.text
            parsed = parse_tool_calls(forced_prefix(self.forced) + text)[1]
            args = parsed[0].arguments if parsed else text.strip()
            return [Call(f"call_{uuid.uuid4().hex[:24]}", self.forced, args)]
        return list(self.worker_calls)

    def content(self) -> str | None:
        if self.forced is not None:
            return None
        text = self.stops.text
        return parse_tool_calls(text)[0] if self.worker_calls else text

    def rest(self) -> str:
        """Text not handed out yet (at the end: all of it when it was held)."""
        delta = self.text_delta()
        if self.forced is not None:
            return ""
        if self.hold_text:
            return self.content() or ""
        return delta

    def openai_finish(self) -> str:
        if self.forced is not None or self.worker_calls:
            return "tool_calls"
        return self.finish_reason or "stop"

    def usage(self) -> dict:
        return {"prompt_tokens": self.l_hist + self.l_incr, "completion_tokens": len(self.tokens),
                "total_tokens": self.l_hist + self.l_incr + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.l_hist}}

    def message(self, calls: list[Call]) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content()}
        if calls:
            msg["tool_calls"] = [c.openai() for c in calls]
        return msg
