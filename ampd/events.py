"""What the decode worker's and the coordinator's event streams share: merging token events."""
from __future__ import annotations

from ampd.v1 import decode_pb2

__all__ = ["merge_tokens"]


def merge_tokens(into: decode_pb2.DecodeEvent, nxt: decode_pb2.DecodeEvent) -> bool:
    """Appends ``nxt``'s tokens to ``into``'s when both are Tokens of the same round, which follow
    each other on a stream: one message where there were two. False (nothing done) otherwise."""
    if not (into.HasField("tokens") and nxt.HasField("tokens") and nxt.tokens.round == into.tokens.round):
        return False
    into.tokens.token_ids.extend(nxt.tokens.token_ids)
    into.tokens.times.extend(nxt.tokens.times)
    if nxt.seq:
        into.seq = nxt.seq  # the merged event's number: its last part's
    return True
