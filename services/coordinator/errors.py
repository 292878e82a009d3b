"""How a session on the coordinator ends when it fails."""
from __future__ import annotations

import grpc


class SessionEnd(Exception):
    """The session ends with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
