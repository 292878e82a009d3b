"""What the coordinator keeps of one session so that it can move to another decode worker when its
own is lost: every token of the session (inputs, tool results and outputs, in order), the turn being
answered and how far it got. Pure: messages in, decisions out.

The decode worker that holds a session's KV also holds its tokens; when it dies, both are gone. The
coordinator sees every token on the way: each round's input in the PrefillTask it routes (the tokens
after the KV held, ``token_ids`` from position ``l_hist``) and each output in the Tokens events it
forwards. From that it builds the Resume a new decode worker needs (ampd/v1 decode.proto): the whole
history as the first input (prefilled there again), the round to continue and the part of the turn
still to come. Rounds keep their numbers and tokens their positions, so the client's stream goes on
where it stopped: the tokens already sent are in the history, the rest follow.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ampd.v1 import common_pb2, decode_pb2


class CannotResume(Exception):
    """The session's state does not allow a move (the message says why)."""


@dataclass
class SessionLog:
    session_id: str
    limits: common_pb2.SessionLimits
    history: list[int] = field(default_factory=list)
    turn: common_pb2.Turn | None = None  # the turn being answered (None: between turns)
    turn_round: int = 0  # the turn's first round
    next_round: int = 0  # the session's next round (after the turn's rounds so far)
    round: int = -1  # the round in progress or last begun (-1: none of this turn yet)
    round_tokens: int = 0  # its output tokens sent so far
    round_ended: bool = False
    server_calls: list[common_pb2.ToolCall] = field(default_factory=list)  # after the round ended
    client_calls: set[str] = field(default_factory=set)  # pending client-side calls (the next turn's)
    timings: dict[int, common_pb2.RoundTiming] = field(default_factory=dict)  # rounds ended
    moves: int = 0
    # A round that continues on a new worker: (round, tokens made before, first token time, input ready)
    carry: tuple[int, int, float, float] | None = None
    first_token_at: float = 0.0  # the current round's first token (server clock)
    input_ready: float = 0.0  # the current round's input ready time (server clock)
    turns: int = 0  # the client's turns (the open's counts): a reattach knows which one never arrived
    prefix_scope: str = ""  # the open's: a moved session shares prefix blocks within it only

    @classmethod
    def from_state(cls, session_id: str, st: decode_pb2.SessionState) -> "SessionLog":
        """The log of a session reattached from its decode worker's state (decode.proto SessionState),
        after its coordinator was lost."""
        return cls(session_id, st.limits, history=list(st.history),
                   turn=st.turn if st.HasField("turn") else None, turn_round=st.turn_round,
                   next_round=st.next_round, round=st.round, round_tokens=st.round_tokens,
                   round_ended=st.round_ended, server_calls=list(st.server_calls),
                   client_calls=set(st.client_calls), timings={t.round: t for t in st.rounds}, moves=st.moves,
                   first_token_at=st.first_token_at, input_ready=st.input_ready, turns=st.turns,
                   prefix_scope=st.prefix_scope)

    # ------------------------------------------------------------------------ what happened
    def on_turn(self, t: common_pb2.Turn) -> None:
        """The client's turn was handed to the decode worker."""
        self.turn = t
        self.turns += 1
        self.turn_round = self.next_round
        self.round, self.round_ended, self.server_calls = -1, False, []
        if t.HasField("keep_tokens"):
            del self.history[t.keep_tokens:]
        self.history.extend(t.token_ids)
        self.client_calls.clear()

    def on_prefill_task(self, task: common_pb2.PrefillTask) -> None:
        del self.history[task.l_hist:]
        self.history.extend(task.token_ids)
        self.on_round_start(task.round, task.input_ready)

    def on_round_start(self, rnd: int, input_ready: float) -> None:
        """Round ``rnd`` began (its input is in the history): from its PrefillTask, or when the
        coordinator routed it with the turn (decode.proto Route)."""
        if self.carry is not None and self.carry[0] == rnd:
            self.round_tokens = self.carry[1]
        else:
            self.round_tokens = 0
            self.first_token_at = 0.0
            self.input_ready = input_ready
        self.round, self.round_ended, self.server_calls = rnd, False, []
        self.next_round = rnd + 1

    def expected_sizes(self, t: common_pb2.Turn) -> tuple[int, int]:
        """(l_hist, l_incr) of the first round of turn ``t`` (before ``on_turn(t)``) on a decode worker
        that holds the session's KV: every token but the last output one, which the next prefill
        computes with the turn's input (services/decode/worker.py). A worker that holds less (it
        evicted the KV, or the session just moved there) computes other sizes: it then ignores a
        route decided for these."""
        kept = min(t.keep_tokens, len(self.history)) if t.HasField("keep_tokens") else len(self.history)
        l_hist = min(max(0, len(self.history) - 1), kept)
        return l_hist, kept + len(t.token_ids) - l_hist

    def on_tokens(self, t: common_pb2.Tokens) -> None:
        del self.history[t.position:]
        self.history.extend(t.token_ids)
        if self.round_tokens == 0 and t.times:
            self.first_token_at = t.times[0]
        self.round_tokens += len(t.token_ids)

    def on_round_end(self, timing: common_pb2.RoundTiming) -> None:
        """Ends the round; a round that continued on a new worker gets its whole count and its
        first token time back (the new worker only saw the rest)."""
        c = self.carry
        if c is not None and c[0] == timing.round:
            if c[1]:
                timing.tokens += c[1]
                timing.first_token = c[2]
            timing.input_ready = c[3]
            self.carry = None
        self.round_ended = True
        self.timings[timing.round] = timing

    def on_tool_call(self, tc: common_pb2.ToolCall) -> None:
        if tc.client_side:
            self.client_calls.add(tc.call_id)
        else:
            self.server_calls.append(tc)

    def on_turn_end(self) -> None:
        self.turn = None

    def rounds(self) -> list[common_pb2.RoundTiming]:
        return [self.timings[r] for r in sorted(self.timings)]

    # --------------------------------------------------------------------------- moving
    def lost(self) -> str:
        """The decode worker is gone: what the session waits for. "turn": a Resume can be built now
        (``resume()``); "idle": nothing was running, the next client turn resumes it (``resume(turn)``);
        "turn_end": the turn had ended on the lost worker but its TurnEnd never came (send
        ``turn_end()``, then idle)."""
        if self.turn is None:
            return "idle"
        if self.round >= 0 and self.round_ended and not self.server_calls and not self._scripted_call():
            return "turn_end"  # it ended with a client-side call, or with its answer
        return "turn"

    def turn_end(self) -> common_pb2.TurnEnd:
        t = self.timings.get(self.round)
        reason = "tool_calls" if self.client_calls else (t.finish_reason if t else "stop")
        self.turn = None
        return common_pb2.TurnEnd(round=self.round, finish_reason=reason, history_tokens=len(self.history))

    def _scripted_call(self) -> common_pb2.ScriptedCall | None:
        """The scripted server-side call that follows the current round, if the turn scripts one."""
        i = self.round - self.turn_round
        script = self.turn.script
        return script[i] if 0 <= i < len(script) and not script[i].tool.client_side else None

    def _sampling(self, i: int) -> common_pb2.SamplingParams:
        """The sampling of the turn's round ``i`` (0: the turn's own; then its scripted calls')."""
        script = self.turn.script
        if i > 0 and i - 1 < len(script) and not script[i - 1].tool.client_side:
            return script[i - 1].sampling
        return self.turn.sampling

    def resume(self, next_turn: common_pb2.Turn | None = None) -> decode_pb2.AttachRequest:
        """The Attach that moves the session to a new decode worker: its history as the first input,
        then what is left of the turn (or ``next_turn``, the client's, when it was idle)."""
        if next_turn is not None:
            if next_turn.tool_call_id and next_turn.tool_call_id not in self.client_calls:
                raise CannotResume(f"turn.tool_call_id: {next_turn.tool_call_id!r} is not a pending call of "
                                   f"the session ({', '.join(sorted(self.client_calls)) or 'none'})")
            self.on_turn(next_turn)
        t = self.turn
        if t is None:
            raise CannotResume("no turn to resume")
        self.moves += 1
        res = decode_pb2.Resume(attempt=self.moves, turns=self.turns)
        turn = common_pb2.Turn(server_tools=t.server_tools)
        i = self.round - self.turn_round  # the round of the turn in progress (-1: none begun)
        if self.round < 0:  # the turn's first round never began: run the turn from its start
            res.round = self.turn_round
            turn.sampling.CopyFrom(t.sampling)
            turn.script.extend(t.script)
        elif not self.round_ended:  # the round goes on where it stopped
            res.round, res.round_tokens = self.round, self.round_tokens
            turn.sampling.CopyFrom(self._sampling(i))
            turn.script.extend(t.script[i:])
            if self.round_tokens >= self._max_tokens(turn.sampling):
                raise CannotResume(f"round {self.round} made all its tokens but never ended")
            self.carry = (self.round, self.round_tokens, self.first_token_at, self.input_ready)
        else:  # the round ended with server-side calls whose results never came: run them again
            res.round, res.rerun_tools = self.round + 1, True
            turn.sampling.CopyFrom(t.sampling)
            turn.script.extend(t.script[i:])
            if not self._scripted_call():
                res.calls.extend(self.server_calls)
        turn.token_ids.extend(self.history)
        if not turn.token_ids:
            raise CannotResume("the session has no tokens yet")
        return decode_pb2.AttachRequest(
            open=common_pb2.OpenSession(session_id=self.session_id, limits=self.limits, turn=turn,
                                        prefix_scope=self.prefix_scope), resume=res)

    def _max_tokens(self, p: common_pb2.SamplingParams) -> int:
        cap = self.limits.max_output_tokens
        return min(p.max_tokens, cap) if cap else p.max_tokens
