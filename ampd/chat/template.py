"""Conversations (OpenAI-style messages) to token ids through the model's chat template.

SmolLM2's template is plain ChatML: every message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`,
a default system prompt comes first when the conversation has none, and it knows nothing of
tools: it ignores `tools`, drops an assistant's `tool_calls` and prints a `tool` message's content
as is. So `ChatFormat` brings tools to it in the Hermes style that Qwen2.5 and Hermes models use,
as plain messages the template then renders:
- `tools` become a block in the system message (appended to the conversation's own system
  message, or a system message of their own, which replaces the template's default prompt);
- an assistant's `tool_calls` are written after its content as `<tool_call>{json}</tool_call>`
  (`ampd.chat.toolcalls.format_tool_call`, the format `parse_tool_calls` reads back);
- a `tool` message becomes `<tool_response>{"name": ..., "content": ...}</tool_response>` in a
  message of role `tool`.

Incremental turns: after an assistant round the session's KV already holds the history, so the
next prefill needs only the tokens that follow. `continuation_ids` (and `tool_result_ids`) take
them from the template itself: the difference between the conversation rendered with and without
the new messages. history + these ids equals rendering the whole conversation when the model's
output tokens are the tokenization of its text (see tests/unit/test_chat_template.py).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from ampd.chat.toolcalls import format_tool_call

__all__ = ["ChatFormat", "TOOLS_PROMPT"]

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_MARK = "\x00ampd-round-end\x00"  # stands for an assistant round's text; no tokenizer emits it
Message = Mapping[str, Any]


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"{where}: must be a string or a list of text parts")


def tool_response(name: str, content: str) -> str:
    return "<tool_response>\n" + json.dumps({"name": name, "content": content}, ensure_ascii=False) \
        + "\n</tool_response>"


class ChatFormat:
    """Renders conversations for one tokenizer (with a chat template)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer: it has no chat template")
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.eos_token or ""

    # --- whole conversations --------------------------------------------------------------------
    def render(self, messages: Sequence[Message], tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_text(messages, tools, add_generation_prompt))

    def render_text(self, messages: Sequence[Message], tools: Sequence[Mapping] | None = None,
                    add_generation_prompt: bool = True) -> str:
        plain = self.plain_messages(messages, tools)
        return self.tokenizer.apply_chat_template(
            plain, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        # the template wrote the special tokens already (as text the tokenizer maps to their ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def plain_messages(self, messages: Sequence[Message], tools: Sequence[Mapping] | None = None
                       ) -> list[dict[str, str]]:
        """The conversation as {role, content} messages a tool-unaware template renders."""
        out: list[dict[str, str]] = []
        call_names: dict[str, str] = {}  # tool_call_id -> function name, for tool messages
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, Mapping) else None
            if role not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role: must be system, user, assistant or tool, got {role!r}")
            text = _text(m.get("content"), f"messages[{i}].content")
            if role == "assistant" and m.get("tool_calls"):
                calls = [self._call_text(c, f"messages[{i}].tool_calls[{j}]", call_names)
                         for j, c in enumerate(m["tool_calls"])]
                text = "\n".join(([text] if text else []) + calls)
            elif role == "tool":
                name = m.get("name") or call_names.get(str(m.get("tool_call_id")))
                if not name:
                    raise ValueError(f"messages[{i}]: a tool message needs a name or the "
                                     "tool_call_id of an earlier call")
                text = tool_response(str(name), text)
            out.append({"role": role, "content": text})
        if tools:
            block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    @staticmethod
    def _call_text(call: Any, where: str, names: dict[str, str]) -> str:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.function.name: missing")
        try:
            text = format_tool_call(fn["name"], fn.get("arguments") or {})
        except ValueError:
            raise ValueError(f"{where}.function.arguments: not a JSON object") from None
        if call.get("id"):
            names[str(call["id"])] = fn["name"]
        return text

    # --- incremental turns ----------------------------------------------------------------------
    def continuation_ids(self, new_messages: Sequence[Message], *, after_eos: bool = True,
                         add_generation_prompt: bool = True) -> list[int]:
        """The tokens that follow an assistant round when `new_messages` (tool results, a user
        message) come next. `after_eos`: the round's output ended with the end-of-turn token (the
        template's message end), which the session already holds as its last token; otherwise
        (a stop string, max_tokens) the ids start by closing the assistant message."""
        if not new_messages:
            raise ValueError("new_messages: empty")
        for i, m in enumerate(new_messages):
            if isinstance(m, Mapping) and m.get("role") == "tool" and not m.get("name"):
                raise ValueError(f"new_messages[{i}].name: a tool result after a round needs the "
                                 "tool's name (the round's calls are not re-rendered)")
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        full = self.render_text([*probe, *new_messages], add_generation_prompt=add_generation_prompt)
        after = full[full.index(_MARK) + len(_MARK):]
        if after_eos:
            if not after.startswith(self.eos_text):
                raise ValueError("after_eos: the template does not end an assistant message with "
                                 f"the end-of-turn token {self.eos_text!r}")
            after = after[len(self.eos_text):]
        return self.encode(after)

    def tool_result_ids(self, name: str, content: str, *, after_eos: bool = True) -> list[int]:
        """The tokens to prefill after an assistant round that ended with a call of tool `name`."""
        return self.continuation_ids([{"role": "tool", "name": name, "content": content}],
                                     after_eos=after_eos)
