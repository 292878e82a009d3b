"""`ampd chat`: a real model served by a local deployment, in a short conversation with a tool.

It starts what `ampd up` starts (Redis, coordinator, a prefill and a decode worker, the decode
worker's sidecar) on the torch engine with `--model` (SmolLM2-135M-Instruct by default), registers
the calculator tool on the sidecar (`ampd.chat.calculator`), and talks to it through the session
API: each user message is a turn; a calculator call in the model's output runs on the sidecar and
its result is the next round's input without a client round trip. For every round it prints the
text, TTFT, mean ITL and where the prefill ran. The default policy is `threshold` at 36 tokens:
inputs that long or longer prefill on the prefill worker, which reads the session's history KV over
NIXL and writes the new KV back; shorter ones prefill on the decode worker. In the scripted
conversation the first turn (the whole prompt) and the calculator's result (42 tokens on SmolLM2)
go remote, the short follow-up stays local.

SmolLM2-135M does not call tools from a tools schema alone; two worked examples earlier in the
conversation (`EXAMPLES`) make it write a Hermes `<tool_call>` for an arithmetic question, greedily.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from ampd.chat.calculator import SCHEMA
from ampd.cli import CliError
from ampd.config import Config, add_flags
from ampd.coordinators import parse_addresses

TOOL_SPEC = "calculator=ampd.chat.calculator:calculator"
SYSTEM = "You are a helpful assistant. Use the calculator tool for arithmetic."


def _call(expression: str, call_id: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}}}]}


# Worked examples the conversation starts with (few-shot): how a calculator call looks.
EXAMPLES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Use the calculator to compute 12 * 7."},
    _call("12 * 7", "c0"),
    {"role": "tool", "tool_call_id": "c0", "content": "84"},
    {"role": "assistant", "content": "12 * 7 = 84."},
    {"role": "user", "content": "Use the calculator to compute 3 + 5."},
    _call("3 + 5", "c1"),
    {"role": "tool", "tool_call_id": "c1", "content": "8"},
    {"role": "assistant", "content": "3 + 5 = 8."},
]
# The scripted conversation (without --prompt): a tool call, then a follow-up on the history.
SCRIPT = (
    "Use the calculator to compute 1234 * 5678.",
    "Thank you. Please tell me in one short sentence what multiplication is and what it is used for.",
)


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def print_round(r, out=sys.stdout) -> None:
    t = r.timing
    where = f"{r.placement} on {t.prefill_worker}"
    print(f"  round {t.round}: prefill {where}, {t.l_incr} new tokens on {t.l_hist} history | "
          f"TTFT {_fmt_s(r.ttft_s)} | ITL {_fmt_s(r.itl_s)} | {t.tokens} tokens | {t.finish_reason}", file=out)
    for line in (r.text.strip() or "(no text)").splitlines():
        print(f"    assistant> {line}", file=out)
    for c in r.tool_calls:
        side = "the client" if c.client_side else "the sidecar"
        print(f"    tool call: {c.name}({c.arguments}) runs on {side}", file=out)


async def converse(address: str, fmt, messages, *, max_tokens: int, interactive: bool, out=sys.stdout) -> int:
    """Runs the conversation; returns the number of rounds answered."""
    from ampd.chat.client import ChatSession

    rounds = 0
    async with ChatSession(address, fmt, f"chat-{int(time.time())}", max_tokens=max_tokens,
                           server_tools=["calculator"], tools=[SCHEMA], history=EXAMPLES) as chat:
        async def one(text: str) -> None:
            nonlocal rounds
            print(f"\nuser> {text}", file=out, flush=True)
            for r in await chat.send(text):
                print_round(r, out)
                rounds += 1
            out.flush()

        for text in messages:
            await one(text)
        while interactive:
            try:
                text = await asyncio.to_thread(input, "\nuser> ")
            except EOFError:
                break
            if text.strip() in ("", "/quit", "/exit"):
                break
            await one(text)
    return rounds


def cmd_chat(args: argparse.Namespace) -> int:
    from ampd.chat.client import ChatError
    from ampd.chat.template import ChatFormat
    from ampd.chat.tokenizer import tokenizer_for
    from ampd.launcher import Deployment

    if args.max_tokens < 1:
        raise CliError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    try:
        fmt = ChatFormat(tokenizer_for("torch", args.model))
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    messages = args.prompt or (() if args.interactive else SCRIPT)
    if args.coordinator_address:  # a deployment already up, serving --model: its coordinators
        try:
            parse_addresses(args.coordinator_address, "--coordinator-address")
            n = asyncio.run(converse(args.coordinator_address, fmt, messages, max_tokens=args.max_tokens,
                                     interactive=args.interactive))
        except (ValueError, ConnectionError) as exc:  # a malformed or unreachable address, named
            raise CliError(str(exc)) from None
        except ChatError as exc:
            raise CliError(f"the session failed: {exc}") from None
        print(f"\n{n} rounds answered", flush=True)
        return 0
    cfg = Config.of(engine="torch", model=args.model, prefill="tp1*1", decode="tp1*1", policy=args.policy,
                    threshold_tokens=args.threshold_tokens, tool=(TOOL_SPEC,), run_dir=args.run_dir,
                    ttft_slo=args.ttft_slo, itl_slo=args.itl_slo)
    dep = Deployment(cfg, ready_timeout_s=args.ready_timeout)
    print(f"chat: model {args.model}; {dep.describe()}; threshold {args.threshold_tokens} tokens; tools: calculator",
          flush=True)
    t0 = time.monotonic()
    with dep:
        print(f"deployment ready in {time.monotonic() - t0:.1f} s (coordinator {dep.coordinator})", flush=True)
        try:
            n = asyncio.run(converse(dep.coordinator, fmt, messages, max_tokens=args.max_tokens,
                                     interactive=args.interactive))
        except ChatError as exc:
            raise CliError(f"the session failed: {exc} (logs in {dep.run_dir})") from None
    print(f"\n{n} rounds answered", flush=True)
    return 0


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a real model on a local deployment (torch engine, a tool)",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    add_flags(p, ("model", "policy", "threshold_tokens", "ttft_slo", "itl_slo", "run_dir", "coordinator_address"))
    p.set_defaults(policy="threshold", threshold_tokens=36)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a user message (repeatable); default: a scripted two-turn conversation with a "
                        "calculator call (none with --interactive)")
    p.add_argument("--interactive", action="store_true",
                   help="after the --prompt messages, read more from standard input (an empty line ends)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per round at most (default: 64)")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the workers to load the model (default: 600)")
    p.set_defaults(func=cmd_chat)
