"""The decode worker's server-side tool calls: between two rounds of a turn, the tool sidecar runs
the calls the round ended with, off the decode loop; their results are the next round's input."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

from ampd import tracing
from ampd.grpcserver import RPC_TIMEOUT_S
from ampd.trust import new_call_id
from ampd.v1 import common_pb2, decode_pb2, sidecar_pb2
from ampd.workload.ids import filler_ids
from services.decode.session import emit, Session

if TYPE_CHECKING:
    from services.decode.worker import DecodeWorker


class ToolCalls:
    """Runs each session's server-side calls as a task of its own; ``stop`` cancels and awaits them."""

    def __init__(self, w: DecodeWorker, sidecar_stub) -> None:
        self.w = w
        self.sidecar = sidecar_stub
        self._tasks: set[asyncio.Task] = set()

    def run(self, s: Session, scripted: common_pb2.ScriptedCall | None, calls: list[tuple[str, str, bool]],
            after_eos: bool) -> None:
        """Runs ``calls`` (name, arguments, client-side) for ``s``; the next round begins with their
        results (``after_eos``: the round's output ended with an end-of-sequence token)."""
        task = asyncio.create_task(self._run(s, scripted, calls, after_eos), name=f"tools-{s.session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def announce(self, s: Session, scripted: common_pb2.ScriptedCall | None, parsed: list) -> bool:
        """The round ended with calls (the turn's scripted one, else those parsed from the output):
        each goes to the client as a ToolCall event. True when they are server-side: they run now
        (``run``) and the turn goes on; False: the turn ends (client-side calls, or none)."""
        w = self.w
        calls = [(scripted.tool.name or "replay", scripted.tool.arguments, scripted.tool.client_side)] if scripted \
            else [(c.name, c.arguments, c.name not in s.turn.server_tools) for c in parsed]
        client = any(side for _, _, side in calls)
        for name, arguments, _ in calls:
            call_id = new_call_id()  # unguessable: the next turn answers a client-side call by it
            tc = common_pb2.ToolCall(round=s.round, call_id=call_id, name=name, arguments=arguments,
                                     client_side=client)
            emit(s, decode_pb2.DecodeEvent(tool_call=tc))
            if not client:
                s.server_calls.append(tc)
            w.metrics["tool_calls"] += 1
            if client:
                s.pending_calls.add(call_id)
        if calls and not client:
            self.run(s, scripted, calls, s.tokens[-1] in w.engine.eos_token_ids)
            return True
        return False

    def rerun(self, s: Session, t: common_pb2.Turn, r: decode_pb2.Resume) -> None:
        """A session moved here whose previous round ended with server-side calls whose results
        never came: they run again (``t`` holds its whole history and the rest of its turn)."""
        s.turn, s.script = t, deque(t.script)
        s.turn_round = s.round_begun = r.round - 1
        s.round_ended = True
        s.tokens.extend(t.token_ids)
        scripted = s.script.popleft() if s.script else None
        calls = [(scripted.tool.name or "replay", scripted.tool.arguments, False)] if scripted \
            else [(c.name, c.arguments, False) for c in r.calls]
        self.run(s, scripted, calls, s.tokens[-1] in self.w.engine.eos_token_ids)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, s: Session, scripted: common_pb2.ScriptedCall | None,
                         calls: list[tuple[str, str, bool]], after_eos: bool) -> None:
        """Off the decode loop: the sidecar runs the round's server-side calls, in order; their
        results are the next round's input (a scripted call's result is ``result_tokens`` long)."""
        w = self.w
        results = []
        for name, arguments, _ in calls:
            latency = scripted.tool.latency_s if scripted else 0.0
            # its span is the parent of the sidecar's (traceparent in the call's metadata)
            span = tracing.start("tool_call", tracing.round_context(s.session_id, s.round), {
                "ampd.session_id": s.session_id, "ampd.round": s.round, "ampd.tool.name": name},
                kind="client") if tracing.on else None
            try:  # the deadline: the tool's own latency and an RPC's
                res = await self.sidecar.Call(sidecar_pb2.ToolCallRequest(
                    session_id=s.session_id, round=s.round, name=name, arguments=arguments,
                    latency_s=latency, result_tokens=scripted.result_tokens if scripted else 0),
                    timeout=latency + RPC_TIMEOUT_S, wait_for_ready=True,  # a restarting sidecar: wait
                    metadata=tracing.metadata(span.context) if span is not None else None)
            except Exception as exc:  # grpc.aio.AioRpcError and connection failures
                detail = exc.details() if hasattr(exc, "details") else exc
                if span is not None:
                    span.end(error=str(detail))
                if not s.closed:
                    w.fail(s, f"tool {name!r} failed: {detail}")
                return
            if span is not None:
                span.end(error=res.error, **{"ampd.tool.result_tokens": res.result_tokens})
            results.append((name, res))
        if s.closed:
            return
        if w.tier is not None:  # the calls' time, as the sidecar measured it, joins the tool's estimate
            w.tier.resumed(s, sum(max(0.0, res.finished - res.started) for _, res in results)
                           if all(res.finished for _, res in results) else None)
        if w.chat is not None and all(res.content for _, res in results):
            ids = w.chat.continuation_ids([{"role": "tool", "name": name, "content": res.content}
                                              for name, res in results], after_eos=after_eos)
        else:  # a replayed result: its length is what matters
            n = sum(res.result_tokens for _, res in results) or (scripted.result_tokens if scripted else 1)
            ids = filler_ids(n, len(s.tokens), w.engine.vocab_size)
        s.tokens.extend(ids)
        w.begin_round(s, scripted.sampling if scripted else s.turn.sampling, len(ids), time.time())
