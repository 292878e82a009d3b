"""Trace replay through the OpenAI-compatible front, the way an agent drives a server: every round
is a streamed `/v1/completions` request that resends the whole history (earlier prompts and the
model's outputs) with the round's new input, after the previous round's tool time. No session
header: the front finds the session by the history's token prefix.

The client is plain HTTP (httpx2, streaming the server-sent events), light enough that a replay of
many sessions measures the server rather than the client's parsing. Token ids, not text, so that
each round has exactly the trace's lengths: the prompt is a list of
ids, `ignore_eos` makes the output the trace's length, and `return_token_ids` (vLLM's name) gives
the output ids to resend; a round's agent hints (`Round.hints`) go as `ampd_hints`. Times are this
client's clock: a round's TTFT runs from sending its request to receiving its first token, so it
includes the front. The report is the gRPC replay's
(`ampd.bench.report`).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

from ampd.agenthints import BODY_FIELD
from ampd.bench.report import RoundRecord, SessionRecord
from ampd.policy.hints import Hints, hints_to_obj
from ampd.workload import Session
from ampd.workload.ids import round_ids

__all__ = ["replay_openai", "OpenAIStats"]


@dataclass
class OpenAIStats:
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0


async def _round(http, model: str, prompt: list[int], output: int,
                 hints: Hints | None = None) -> tuple[list[int], list[float], dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
    if hints is not None:  # the round's agent hints, as an agent sends them (docs/frontend.md)
        body[BODY_FIELD] = hints_to_obj(hints)
    ids: list[int] = []
    times: list[float] = []
    info: dict = {}
    async with http.stream("POST", "/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.time()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "error"))
            for c in chunk.get("choices", ()):
                new = c.get("token_ids") or []
                ids.extend(new)
                times.extend([now] * len(new))
            if chunk.get("ampd"):
                info.update(chunk["ampd"])
            if chunk.get("usage"):
                info["usage"] = chunk["usage"]
    return ids, times, info


async def run_session(client, model: str, s: Session, stats: OpenAIStats) -> SessionRecord:
    history: list[int] = []
    rounds: list[RoundRecord] = []
    error = ""
    arrival = time.time()
    for i, r in enumerate(s.rounds):
        if i:
            await asyncio.sleep(s.rounds[i - 1].tool_s or 0.0)
        prompt = history + round_ids(r.input, len(history), r.hash_ids, session=s.id)
        sent = time.time()
        try:
            ids, times, info = await _round(client, model, prompt, r.output, r.hints)
        except Exception as exc:  # an HTTP error, a failed session, a lost connection: the session fails
            error = f"round {i}: {type(exc).__name__}: {exc}"
            stats.errors.append(f"{s.id}: {error}")
            break
        history = prompt + ids
        stats.tokens += len(ids)
        usage = info.get("usage")
        if usage is not None:
            stats.prompt_tokens += usage["prompt_tokens"]
            stats.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rounds.append(RoundRecord(session_id=s.id, round=i, input_ready=sent, first_token=times[0] if times else None,
                                  token_times=tuple(times), local=info.get("local"), l_hist=info.get("l_hist", 0),
                                  l_incr=info.get("l_incr", 0)))
    completed = not error and len(rounds) == len(s.rounds)
    return SessionRecord(s.id, rounds[0].input_ready if rounds else arrival, tuple(rounds), completed, error)


async def replay_openai(target: str, sessions: list[Session], *, model: str = "", api_key: str = "",
                        progress: bool = True, timeout_s: float = 600.0
                        ) -> tuple[list[SessionRecord], OpenAIStats, float, dict]:
    """Replays `sessions` at their arrival times through the front at `target` (its URL, with or
    without /v1); returns records, stats, wall seconds and labels."""
    import httpx2

    base = target.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    # one connection per concurrent session at most, kept alive through the tool time as an agent's is
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=60.0)
    client = httpx2.AsyncClient(base_url=base, headers=headers, timeout=timeout_s, limits=limits)
    try:
        resp = await client.get("/models")
        resp.raise_for_status()
        served = [m["id"] for m in resp.json()["data"]]
    except (httpx2.HTTPError, ValueError, KeyError) as exc:
        await client.aclose()
        raise ConnectionError(f"cannot reach the front at {base}: {exc}") from None
    model = model or served[0]
    stats = OpenAIStats()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sessions), unit="session", file=sys.stderr, dynamic_ncols=True, desc="replay")
    t0 = time.monotonic()

    async def one(s: Session) -> SessionRecord:
        delay = s.arrival - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        rec = await run_session(client, model, s, stats)
        if bar is not None:
            bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(s) for s in sessions))
    finally:
        if bar is not None:
            bar.close()
        await client.aclose()
    return list(records), stats, time.monotonic() - t0, {"api": "openai", "model": model}
