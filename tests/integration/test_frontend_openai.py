"""The OpenAI-compatible front driven by the official `openai` client, on a real deployment (Redis,
coordinator, decode worker, sidecar) running the torch engine on a tiny random-weight Llama that
carries SmolLM2's tokenizer and chat template.

One conversation, as an agent sends it (the whole history every turn, no session header): two
streamed chat turns, then a tool-call round trip (`tools`, `tool_choice` naming the function, the
answer's `tool_calls`, a `role: tool` result). Every turn after the first reports cached prompt
tokens of at least the previous request's prompt, and the decode worker prefills only the new
tokens (its `ampd_local_prefill_tokens_total` counter; the `local` policy runs every prefill there).
"""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ampd.launcher import Deployment, Options
from tests.integration.fronts import tiny_chat_llama

pytestmark = pytest.mark.timeout(180)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory):
    return tiny_chat_llama(tmp_path_factory.mktemp("chat-llama"))


@pytest.fixture(scope="module")
def front(chat_llama, redis_url, tmp_path_factory):
    opts = Options(prefill="none", decode="tp1*1", engine="torch", model=str(chat_llama), policy="local",
                   redis_url=redis_url, namespace="front-openai", ttft_slo=5.0, itl_slo=1.0,
                   run_dir=str(tmp_path_factory.mktemp("run")))
    with Deployment(opts, frontend=True) as dep:
        yield dep


def _counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not in {url}")


def _stream(client, messages, **kw):
    """A streamed chat turn: (content, tool_calls, finish_reason, usage)."""
    content, calls, finish, usage = [], [], None, None
    for chunk in client.chat.completions.create(messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content.append(c.delta.content or "")
            calls.extend(c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    return "".join(content), calls, finish, usage


def test_multi_turn_chat_and_tool_round_trip(front, chat_llama):
    client = openai.OpenAI(base_url=f"{front.frontend}/v1", api_key="unused", max_retries=0, timeout=60)
    model = str(chat_llama)
    assert [m.id for m in client.models.list()] == [model]
    decode_metrics = front.metrics["decode-0"]
    prefilled = "ampd_local_prefill_tokens_total"
    kw = dict(model=model, max_tokens=6, temperature=0, tools=TOOLS)

    messages = [{"role": "user", "content": "Hello! What can you do?"}]
    text1, calls1, finish1, u1 = _stream(client, messages, **kw)
    assert finish1 in ("stop", "length") and not calls1
    assert u1.prompt_tokens_details.cached_tokens == 0 and u1.completion_tokens >= 1
    before = _counter(decode_metrics, prefilled)

    # turn 2: the history resent, one user message more
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Tell me more."}]
    text2, _, _, u2 = _stream(client, messages, **kw)
    cached2 = u2.prompt_tokens_details.cached_tokens
    assert cached2 >= u1.prompt_tokens
    # the history's KV: prompt and output, but the last output token (the next prefill computes it)
    assert cached2 == u1.prompt_tokens + u1.completion_tokens - 1
    new2 = u2.prompt_tokens - cached2
    assert _counter(decode_metrics, prefilled) - before == new2
    assert new2 < 40  # the closing of the answer, one user message and the generation prompt

    # turn 3: the model is made to call the tool (tool_choice names it; the arguments are its own)
    messages += [{"role": "assistant", "content": text2},
                 {"role": "user", "content": "What is the weather in Paris?"}]
    before = _counter(decode_metrics, prefilled)
    reply = client.chat.completions.create(messages=messages,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           **kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    u3 = reply.usage
    assert u3.prompt_tokens_details.cached_tokens >= u2.prompt_tokens
    assert _counter(decode_metrics, prefilled) - before == u3.prompt_tokens - u3.prompt_tokens_details.cached_tokens

    # turn 4: the tool's result comes back as a role: tool message
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18})}]
    before = _counter(decode_metrics, prefilled)
    text4, calls4, finish4, u4 = _stream(client, messages, **kw)
    assert finish4 in ("stop", "length")
    cached4 = u4.prompt_tokens_details.cached_tokens
    assert cached4 >= u3.prompt_tokens
    assert cached4 == u3.prompt_tokens + u3.completion_tokens - 1
    assert _counter(decode_metrics, prefilled) - before == u4.prompt_tokens - cached4


def test_agent_hints_are_advice_and_a_bad_one_is_named(front, chat_llama):
    """`ampd_hints` (issue 29): greedy tokens are the same with hints as without, in a session of
    their own each, on both endpoints; a bad hint is a 400 whose `param` names it."""
    client = openai.OpenAI(base_url=f"{front.frontend}/v1", api_key="unused", max_retries=0, timeout=60)
    model = str(chat_llama)
    hints = {"priority": -5, "expected_output_tokens": 3, "expected_tool_s": 30.0}
    prompt = "The capital of France is"
    kw = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    plain = client.completions.create(extra_headers={"x-session-id": "hints-plain"}, **kw)
    hinted = client.completions.create(extra_headers={"x-session-id": "hints-hinted"},
                                       **{**kw, "extra_body": {"return_token_ids": True, "ampd_hints": hints}})
    assert plain.ampd["session_id"] != hinted.ampd["session_id"]
    assert hinted.choices[0].token_ids == plain.choices[0].token_ids and len(plain.choices[0].token_ids) >= 1
    assert hinted.choices[0].text == plain.choices[0].text

    chat = dict(model=model, max_tokens=6, temperature=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    a = client.chat.completions.create(messages=messages, extra_headers={"x-session-id": "hints-chat-a"}, **chat)
    b = client.chat.completions.create(messages=messages, extra_headers={"x-session-id": "hints-chat-b"},
                                       extra_body={"ampd_hints": {"priority": 7, "expected_tool_s": 0}}, **chat)
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage.completion_tokens == a.usage.completion_tokens

    for bad, param in [({"expected_tool_s": -1}, "ampd_hints.expected_tool_s"),
                       ({"priority": 1000}, "ampd_hints.priority"),
                       ({"expected_output_tokens": 0}, "ampd_hints.expected_output_tokens"),
                       ({"speculative_prefill": True}, "ampd_hints.speculative_prefill")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(messages=messages, extra_body={"ampd_hints": bad}, **chat)
        err = e.value.response.json()["error"]
        assert e.value.status_code == 400 and err["param"] == param and err["message"].startswith(param + ":"), err
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**kw, "extra_body": {"ampd_hints": bad}})
        assert e.value.response.json()["error"]["param"] == param
