"""Trace replay over gRPC: one Coordinator.Session stream per trace session, at its arrival time.

Times in the records are the servers' clocks (unix seconds): a round's TTFT runs from its input
being ready (the coordinator accepting the session, or the tool result) to its first token.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

import grpc

from ampd.agenthints import hints_to_turn
from ampd.bench.report import SLO, RoundRecord, SessionRecord, build_report, format_report
from ampd.engine.mock import token_at
from ampd.coordinators import Coordinators, parse_addresses, session_events
from ampd.v1 import common_pb2, coordinator_pb2
from ampd.workload import Session
from ampd.workload.ids import round_ids


def replay_sampling(output: int) -> common_pb2.SamplingParams:
    """A replayed round decodes exactly the trace's output length (vLLM's benchmark: ignore_eos)."""
    return common_pb2.SamplingParams(max_tokens=output, ignore_eos=True)


def replay_call(s: Session, i: int, client_side: bool) -> common_pb2.ScriptedCall:
    """The tool call that ends round ``i`` (not the last) of a trace session."""
    r, nxt = s.rounds[i], s.rounds[i + 1]
    tool = common_pb2.ToolSpec(name=r.tool or "replay", latency_s=r.tool_s or 0.0, client_side=client_side)
    if client_side:
        return common_pb2.ScriptedCall(tool=tool)
    return common_pb2.ScriptedCall(tool=tool, result_tokens=nxt.input, sampling=replay_sampling(nxt.output))


def replay_turn(s: Session, i: int, position: int, client_tools: bool) -> common_pb2.Turn:
    """Round ``i``'s input as a turn, with the round's agent hints (``Round.hints``). With server-side
    tools the turn scripts every later round (each tool's result is the next round's input, on the
    decode worker), and its hints, round ``i``'s, stand for all of them; with client tools, one round."""
    r = s.rounds[i]
    last = len(s.rounds) - 1
    calls = range(i, i + 1 if client_tools else last) if i < last else ()
    t = common_pb2.Turn(token_ids=round_ids(r.input, position, r.hash_ids, session=s.id), sampling=replay_sampling(r.output),
                        script=[replay_call(s, j, client_tools) for j in calls])
    if r.hints is not None:
        hints_to_turn(r.hints, t)
    return t


def open_request(s: Session, client_tools: bool = False) -> common_pb2.OpenSession:
    return common_pb2.OpenSession(session_id=s.id, turn=replay_turn(s, 0, 0, client_tools))


@dataclass
class ReplayStats:
    token_mismatches: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    client_latency: list[float] = field(default_factory=list)  # client send -> first token seen
    bound_to: dict[str, str] = field(default_factory=dict)  # session id -> decode worker (first event)
    started_at: dict[str, float] = field(default_factory=dict)  # session id -> client clock at its open
    ended_at: dict[str, float] = field(default_factory=dict)  # session id -> client clock at its end
    recovered_rounds: dict[str, int] = field(default_factory=dict)  # session id -> rounds marked recovered
    failovers: dict[str, int] = field(default_factory=dict)  # session id -> coordinators it went on through
    restarts: dict[str, int] = field(default_factory=dict)  # session id -> times it was opened again


def _first_token_positions(s: Session) -> dict[int, int]:
    """The expected position of each round's first token: all earlier inputs and outputs, plus this input."""
    expect_pos, pos = {}, 0
    for i, r in enumerate(s.rounds):
        pos += r.input
        expect_pos[i] = pos
        pos += r.output
    return expect_pos


def _on_tokens(t: common_pb2.Tokens, s: Session, stats: ReplayStats, tokens: dict[int, list[float]],
               sent_at: dict[int, float], expect_pos: dict[int, int] | None) -> None:
    """A Tokens event: its times noted, its round's client latency at its first; with ``expect_pos``,
    each token checked against the one the mock engine makes at its position."""
    if t.round not in tokens:
        tokens[t.round] = []
        if t.round in sent_at:
            stats.client_latency.append(time.time() - sent_at[t.round])
    tokens[t.round].extend(t.times)
    stats.tokens += len(t.token_ids)
    if expect_pos is not None:
        start = expect_pos.get(t.round, -1) + len(tokens[t.round]) - len(t.token_ids)
        for i, tok in enumerate(t.token_ids):
            if t.position + i != start + i or tok != token_at(s.id, t.position + i):
                stats.token_mismatches += 1


def _round_records(sid: str, timings: dict[int, common_pb2.RoundTiming], tokens: dict[int, list[float]],
                   arrival: float) -> list[RoundRecord]:
    """A record of each round seen: its server timing where it came, else what the client saw."""
    rounds = []
    for rnd in sorted(set(timings) | set(tokens)):
        t = timings.get(rnd)
        times = tuple(tokens.get(rnd, ()))
        rounds.append(RoundRecord(
            session_id=sid, round=rnd,
            input_ready=t.input_ready if t else (arrival if rnd == 0 else times[0] if times else arrival),
            first_token=(t.first_token if t else (times[0] if times else None)),
            token_times=times, local=(t.local if t else None),
            l_hist=t.l_hist if t else 0, l_incr=t.l_incr if t else 0))
    return rounds


async def run_session(coordinator, s: Session, stats: ReplayStats, *, verify_tokens: bool = False,
                      client_tools: bool = False, timeout_s: float = 600.0) -> SessionRecord:
    """Runs one session to its end and returns what happened to it."""
    outbox: asyncio.Queue = asyncio.Queue()
    await outbox.put(coordinator_pb2.ClientMessage(open=open_request(s, client_tools)))
    sent_at = {0: time.time()}

    async def requests():
        while True:
            msg = await outbox.get()
            if msg is None:
                return
            yield msg

    tokens: dict[int, list[float]] = {}
    timings: dict[int, common_pb2.RoundTiming] = {}
    arrival = time.time()
    stats.started_at[s.id] = arrival
    completed, error = False, ""
    expect_pos = _first_token_positions(s)
    call = coordinator.Session(requests(), timeout=timeout_s)
    try:
        async for ev in session_events(call):
            if ev.decode_worker and s.id not in stats.bound_to:
                stats.bound_to[s.id] = ev.decode_worker
            kind = ev.WhichOneof("event")
            if kind == "tokens":
                _on_tokens(ev.tokens, s, stats, tokens, sent_at, expect_pos if verify_tokens else None)
            elif kind == "round_end":
                timings[ev.round_end.timing.round] = ev.round_end.timing
            elif kind == "tool_call" and ev.tool_call.client_side:
                rnd = ev.tool_call.round
                await asyncio.sleep(s.rounds[rnd].tool_s or 0.0)
                sent_at[rnd + 1] = time.time()
                turn = replay_turn(s, rnd + 1, expect_pos[rnd + 1] - s.rounds[rnd + 1].input, True)
                turn.tool_call_id = ev.tool_call.call_id
                await outbox.put(coordinator_pb2.ClientMessage(turn=turn))
            elif kind == "turn_end" and ev.turn_end.round + 1 >= len(s.rounds):
                await outbox.put(None)  # half-close: the session ends (SessionDone)
            elif kind == "done":
                completed = True
                for t in ev.done.rounds:
                    timings[t.round] = t
                break
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
        stats.errors.append(f"{s.id}: {error}")
    finally:
        stats.ended_at[s.id] = time.time()
        stats.recovered_rounds[s.id] = sum(1 for t in timings.values() if t.recovered)
        stats.failovers[s.id] = getattr(call, "failovers", 0)
        stats.restarts[s.id] = getattr(call, "restarts", 0)
        await outbox.put(None)
        call.cancel()
    rounds = _round_records(s.id, timings, tokens, arrival)
    if completed and (len(rounds) != len(s.rounds)):
        completed, error = False, f"expected {len(s.rounds)} rounds, got {len(rounds)}"
    arrival_server = rounds[0].input_ready if rounds else arrival
    return SessionRecord(s.id, arrival_server, tuple(rounds), completed, error)


async def replay(target: str, sessions: list[Session], *, verify_tokens: bool = False,
                 client_tools: bool = False, progress: bool = True,
                 timeout_s: float = 600.0) -> tuple[list[SessionRecord], ReplayStats, float, dict]:
    """Replays `sessions` at their arrival times; returns records, stats, wall seconds, labels.
    ``target``: the coordinator's HOST:PORT, or several sharing one Redis, comma-separated (new
    sessions go to each in turn; a session whose coordinator is lost goes on through another:
    ampd.coordinators)."""
    coordinator = Coordinators(parse_addresses(target))
    try:
        info = await coordinator.check()
    except ConnectionError:
        await coordinator.close()
        raise
    stats = ReplayStats()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sessions), unit="session", file=sys.stderr, dynamic_ncols=True,
                   desc="replay")
    t0 = time.monotonic()

    async def one(s: Session) -> SessionRecord:
        delay = s.arrival - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        rec = await run_session(coordinator, s, stats, verify_tokens=verify_tokens,
                                client_tools=client_tools, timeout_s=timeout_s)
        if bar is not None:
            bar.update(1)
            if stats.errors:
                bar.set_postfix(failed=len(stats.errors))
        return rec

    try:
        records = await asyncio.gather(*(one(s) for s in sessions))
    finally:
        if bar is not None:
            bar.close()
        await coordinator.close()
    return list(records), stats, time.monotonic() - t0, dict(info.labels)


def run_bench_cli(target: str, trace: str, ttft_slo: float, itl_slo: float, *, json_out: str | None = None,
                  verify_tokens: bool = False, client_tools: bool = False,
                  timeout_s: float = 600.0, api: str = "grpc", model: str = "", api_key: str = "") -> int:
    from ampd.cli import CliError
    from ampd.workload import TraceError, load_trace

    try:
        slo = SLO(ttft_slo, itl_slo)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    try:
        sessions = load_trace(trace)
    except (TraceError, OSError) as exc:
        raise CliError(str(exc)) from exc
    if not sessions:
        raise CliError(f"{trace}: no sessions")
    import uvloop

    extra: dict = {}
    try:
        if api == "openai":
            from ampd.bench.openai_client import replay_openai

            records, ostats, wall, labels = uvloop.run(replay_openai(target, sessions, model=model, api_key=api_key,
                                                                     timeout_s=timeout_s))
            errors = ostats.errors
            extra = {"prompt_tokens": ostats.prompt_tokens, "cached_prompt_tokens": ostats.cached_tokens}
        else:
            records, stats, wall, labels = uvloop.run(replay(target, sessions, verify_tokens=verify_tokens,
                                                             client_tools=client_tools, timeout_s=timeout_s))
            errors = stats.errors
    except ConnectionError as exc:
        raise CliError(str(exc)) from exc
    report = build_report(labels.get("policy", "unknown"), records, slo, wall)
    report["trace"] = trace
    report["target"] = target
    report["api"] = api
    report["labels"] = labels
    report["wall_s"] = wall
    report.update(extra)
    if verify_tokens and api == "grpc":
        report["token_mismatches"] = stats.token_mismatches
    print(format_report(report))
    if api == "grpc":
        # Per session (client clock): where it was bound and how it ended, for fault and swap checks.
        report["sessions"] = [{"id": r.session_id, "decode_worker": stats.bound_to.get(r.session_id, ""),
                               "completed": r.completed, "error": r.error, "rounds": len(r.rounds),
                               "started": stats.started_at.get(r.session_id),
                               "ended": stats.ended_at.get(r.session_id),
                               "recovered_rounds": stats.recovered_rounds.get(r.session_id, 0),
                               "failovers": stats.failovers.get(r.session_id, 0),
                               "restarts": stats.restarts.get(r.session_id, 0)}
                              for r in records]
    for e in errors[:5]:
        print(f"  failed: {e}", file=sys.stderr)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_out}", file=sys.stderr)
    return 0
