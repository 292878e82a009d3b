"""The decode worker's side of an engine that decodes a whole round as one request of its own
(`streams_rounds`, the sglang engine; ampd.engine.base): the worker tells it where the round stops
and when a round starts or ends; the engine batches the rounds itself, and `decode_step` hands the
worker each round's next token. The worker still decides every stop (DecodeWorker `Session.finish`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ampd.engine.base import RoundStops, round_stops

if TYPE_CHECKING:
    from services.decode.worker import Session


def streams_rounds(engine: Any) -> bool:
    return engine.capabilities.streams_rounds


def stops_of(s: "Session", engine: Any) -> RoundStops:
    """The round's stops as `Session.finish` applies them (stop strings and a client's StopRound end
    the engine's round early, through `end_round`)."""
    p = s.params
    return round_stops(s.max_tokens(), p.stop_token_ids, p.ignore_eos, engine.eos_token_ids)


def continue_remote_round(s: "Session", engine: Any) -> None:
    """A remote prefill made the round's first token: the engine decodes the rest of it here."""
    engine.open_round(s.session_id, s.tokens, s.sampling, stops_of(s, engine))
