"""A whole conversation (OpenAI messages) as the token ids a session holds.

An agent resends the whole conversation every turn, its earlier answers included. The session that
answered them holds the model's own output ids, which are not always what the answer's text
tokenizes to (a model may emit a word in pieces the tokenizer would merge). So `render_conversation`
builds the ids piece by piece, the way the session grew:

    render(messages before the first answer, generation prompt)
    + answer 1            the ids the model produced, when `known` has them; else its text's ids
    + continuation ids    the messages up to the next answer, with the next generation prompt
    + answer 2 ...

`known` maps an answer's digest (`answer_digest`: its content and tool calls, as the front returned
them) to the ids its session holds for it. When every answer is unknown, the result is the whole
conversation rendered at once (tests/unit/test_chat_conversation.py). Pure.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ampd.chat.template import ChatFormat, _text
from ampd.chat.toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, format_tool_call

__all__ = ["Rendered", "render_conversation", "answer_digest"]


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    answers: int  # assistant messages in the conversation
    known: int  # of them, how many `known` had the ids of


def answer_digest(content: Any, tool_calls: Sequence[Mapping] | None) -> str:
    """Names one answer by what the client sends back: its text and its calls (id, name, arguments)."""
    calls = []
    for c in tool_calls or ():
        fn = c.get("function") if isinstance(c, Mapping) else None
        fn = fn if isinstance(fn, Mapping) else {}
        calls.append([str(c.get("id", "")) if isinstance(c, Mapping) else "", str(fn.get("name", "")),
                      str(fn.get("arguments", ""))])
    text = _text(content, "content") if content is None or isinstance(content, (str, list)) else str(content)
    body = json.dumps([text, calls], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def render_conversation(fmt: ChatFormat, messages: Sequence[Mapping], tools: Sequence[Mapping] | None,
                        known: Callable[[str], list[int] | None]) -> Rendered:
    """The conversation's ids, ending with the generation prompt (see the module doc). Raises
    ValueError naming the message of a bad field."""
    messages = _named_tool_results(messages)
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    # every other message's fields are checked once, with their index (answers are rendered below)
    fmt.plain_messages([m for m in messages if m.get("role") != "assistant"], tools)
    if not answers or answers[-1] == len(messages) - 1 or _adjacent(answers):
        # no answer to reuse, or a shape the piecewise build does not cover: render it whole
        return Rendered(fmt.render(messages, tools), len(answers), 0)
    ids = fmt.render(messages[:answers[0]], tools)
    n_known = 0
    eos_ids = {fmt.tokenizer.eos_token_id}
    for j, a in enumerate(answers):
        m = messages[a]
        seg = known(answer_digest(m.get("content"), m.get("tool_calls")))
        if seg:
            n_known += 1
        else:
            seg = fmt.encode(_answer_text(m)) + fmt.encode(fmt.eos_text)
        ids += seg
        end = answers[j + 1] if j + 1 < len(answers) else len(messages)
        ids += fmt.continuation_ids(messages[a + 1:end], after_eos=seg[-1] in eos_ids)
    return Rendered(ids, len(answers), n_known)


def _answer_text(m: Mapping) -> str:
    """An answer as the model is shown it: its text, then its calls. Arguments that are no JSON
    object (a model may write those) are written as they are, inside the call."""
    parts = [_text(m.get("content"), "content")] if m.get("content") else []
    for c in m.get("tool_calls") or ():
        fn = c.get("function") or {}
        try:
            parts.append(format_tool_call(fn.get("name", ""), fn.get("arguments") or "{}"))
        except ValueError:
            parts.append(f"{TOOL_CALL_OPEN}\n{{\"name\": {json.dumps(fn.get('name', ''), ensure_ascii=False)}, "
                         f"\"arguments\": {fn.get('arguments')}}}\n{TOOL_CALL_CLOSE}")
    return "\n".join(parts)


def _adjacent(answers: list[int]) -> bool:
    return any(b == a + 1 for a, b in zip(answers, answers[1:]))


def _named_tool_results(messages: Sequence[Mapping]) -> list[Mapping]:
    """Tool messages carry the name of the call they answer (continuation ids need it)."""
    names: dict[str, str] = {}
    out: list[Mapping] = []
    for m in messages:
        if not isinstance(m, Mapping):
            out.append(m)
            continue
        if m.get("role") == "assistant":
            for c in m.get("tool_calls") or ():
                fn = c.get("function") if isinstance(c, Mapping) else None
                if isinstance(fn, Mapping) and c.get("id"):
                    names[str(c["id"])] = str(fn.get("name"))
        elif m.get("role") == "tool" and not m.get("name") and str(m.get("tool_call_id")) in names:
            m = {**m, "name": names[str(m.get("tool_call_id"))]}
        out.append(m)
    return out
