"""The session API's gRPC statuses as the front's HTTP errors (services/frontend/turn.py)."""
from __future__ import annotations

import grpc
import pytest

from services.frontend.turn import grpc_error


def _rpc(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code,details,status,param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "open.turn.sampling.max_tokens: 900 context tokens + 300 exceed the model's "
                                       "limit of 1024", 400, "max_tokens"),
    (grpc.StatusCode.INVALID_ARGUMENT, "open.turn.sampling.stop: stop strings need an engine with a tokenizer", 400,
     "stop"),
    (grpc.StatusCode.INVALID_ARGUMENT, "turn.token_ids[3]: 60000 is outside the vocabulary", 400, "messages"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "no decode worker has KV for a new session", 429, None),
    (grpc.StatusCode.UNAVAILABLE, "no decode worker is serving", 503, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", 504, None),
    (grpc.StatusCode.INTERNAL, "boom", 500, None),
])
def test_statuses_map_to_openai_errors(code, details, status, param):
    e = grpc_error(_rpc(code, details))
    assert (e.status, e.param) == (status, param)
    assert e.message == details and e.code == code.name.lower()


def test_a_session_that_ended_without_a_status_is_a_502():
    e = grpc_error(None)
    assert e.status == 502 and e.code == "session_ended"
