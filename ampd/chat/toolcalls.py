"""Tool calls in a round's output, in the Hermes / ChatML format:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` splits an output text into its content and its calls. A block whose body is not
a JSON object with a string "name" (and an object "arguments", or none) is no call: it stays in the
content as the model wrote it. The last block may lack its closing tag when the round stopped on
`</tool_call>` (a stop string is cut from the text): it counts when its JSON is complete.
`format_tool_call` writes a call the same way, for a chat template to show the model its own calls.
Pure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["ParsedCall", "parse_tool_calls", "format_tool_call", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# a block's body runs to its closing tag, or to the end of the text, but never into another block
_BLOCK = re.compile(
    rf"{re.escape(TOOL_CALL_OPEN)}((?:(?!{re.escape(TOOL_CALL_OPEN)}).)*?)(?:{re.escape(TOOL_CALL_CLOSE)}|\Z)",
    re.S,
)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's function.arguments carries it


def _call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """(content, calls): the text without its well-formed tool-call blocks, and those calls in
    order. The content is stripped of the whitespace the blocks leave around them."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[pos:m.start()])
        pos = m.end()
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def format_tool_call(name: str, arguments: str | dict) -> str:
    """One call as the model is asked to write it; `arguments` a JSON object or its text."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
