"""Which session-stream failures a client with several coordinators takes as the coordinator lost."""
import grpc
import pytest

from ampd.coordinators import CORE_TRANSPORT_INTERNAL, FAILOVER, stream_code


def _err(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_grpc_cores_unclassified_transport_failure_fails_over_like_a_lost_coordinator():
    assert stream_code(_err(grpc.StatusCode.INTERNAL, CORE_TRANSPORT_INTERNAL)) == grpc.StatusCode.UNAVAILABLE
    assert stream_code(_err(grpc.StatusCode.INTERNAL, CORE_TRANSPORT_INTERNAL)) in FAILOVER


@pytest.mark.parametrize("code,details", [
    (grpc.StatusCode.INTERNAL, "decode worker decode-0: KV exhausted"),  # a server's own INTERNAL: an answer
    (grpc.StatusCode.INVALID_ARGUMENT, "turn.sampling.max_tokens: 0"),
    (grpc.StatusCode.NOT_FOUND, "no such session"),
    (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
])
def test_every_other_status_is_taken_as_it_is(code, details):
    assert stream_code(_err(code, details)) == code
