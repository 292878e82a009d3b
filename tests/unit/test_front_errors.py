"""The session API's gRPC statuses as the front's HTTP errors (services/frontend/turn.py)."""
from __future__ import annotations

import grpc
import pytest

from services.frontend.turn import grpc_error


def _rpc(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code,details,status,param", [
    (grpc.StatusCode.INVALID_ARGUMENT, "open.turn.sampling.max_tokens: 900 context tokens + 300 output tokens to come exceed the model's "
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


# ------------------------------------------------ issue 24: permanent errors are never retryable
@pytest.mark.parametrize("code,details,status,param,err_code,retry", [
    # the session needs more KV than any decode worker holds: no retry can help
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: kv-size: the session may need 300000 KV tokens, more than any "
                                         "decode worker holds (4096)", 400, "messages", "context_length_exceeded",
     None),
    # the turn does not fit a gRPC message (the front's own channel refuses to send it)
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger than max (5000000 vs. 4194304)", 413, "messages",
     "context_length_exceeded", None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: kv-full: no decode worker had KV for 40 tokens within 0 s", 429,
     None, "resource_exhausted", 1.0),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: queue-full: 256 sessions wait", 429, None, "resource_exhausted",
     1.0),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: ttft: predicted 3.1 s over the SLO", 429, None,
     "resource_exhausted", 1.0),
    (grpc.StatusCode.UNAVAILABLE, "no decode worker is serving", 503, None, "unavailable", 1.0),
    (grpc.StatusCode.ABORTED, "decode worker failed", 502, None, "aborted", None),
    (grpc.StatusCode.INVALID_ARGUMENT, "open.turn.sampling.stop_token_ids: at most 64", 400, "stop_token_ids",
     "invalid_argument", None),
    (grpc.StatusCode.INVALID_ARGUMENT, "turn.sampling.stop[3]: must be 1 to 256 characters", 400, "stop",
     "invalid_argument", None),
    (grpc.StatusCode.INVALID_ARGUMENT, "open.turn.sampling.seed: bad", 400, "seed", "invalid_argument", None),
])
def test_errors_are_classified_permanent_or_retryable(code, details, status, param, err_code, retry):
    e = grpc_error(_rpc(code, details))
    assert (e.status, e.param, e.code, e.retry_after) == (status, param, err_code, retry)
    assert (e.status in (429, 503)) == (retry is not None)
