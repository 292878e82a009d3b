"""A server accepts the keepalive pings of AMPD's own channels (ampd.grpcserver; issue 24: the
front's channel was closed by GOAWAY too_many_pings, dropping every session on it)."""
from __future__ import annotations

from ampd import grpcserver


def test_servers_permit_the_channels_keepalive_rate():
    server, channel = dict(grpcserver.SERVER_OPTIONS), dict(grpcserver.CHANNEL_OPTIONS)
    # gRPC's server default (300 s between pings without data, 2 strikes) would strike every
    # keepalive ping of a channel pinging each 20 s
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < channel["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1
