"""Credentials between services (docs/security.md).

- A *task token*: a decode worker reserves KV blocks for a prefill task and mints the token, an HMAC
  of the task's identity and segments under the worker's task key. The key is published with the
  worker's registration in Redis (readable only by who may read Redis). A prefill worker checks the
  token before it reads or writes a byte, so a forged or altered task (another session's blocks)
  cannot make it write KV it was not given.
- A *session secret*: minted by the coordinator when it opens a session; the decode worker acts on
  that session's Turn, Close, Cancel and LocalPrefill only with it.
- An *attach token*: the coordinator's proof that it admitted a session onto a decode worker, an
  HMAC of the session id, the worker id and the session secret under a key derived from that
  worker's task key (published in Redis, like the task key itself). The decode worker opens a
  session, and allocates its KV, only with it.
- A *reattach token*: the client's, derived from the session secret: with it, another coordinator
  takes the session over when the client's own is lost.
- Tool call ids are random, not derived from the session id and round.

Pure: no I/O.
"""
from __future__ import annotations

import hmac
import secrets
import struct
from collections.abc import Sequence

from ampd.v1 import common_pb2

__all__ = ["new_key", "new_secret", "new_call_id", "task_token", "attach_token", "reattach_token", "token_matches",
           "redacted"]


def new_key() -> bytes:
    return secrets.token_bytes(32)


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _task_message(task: common_pb2.PrefillTask, history: Sequence | None, dest: Sequence | None) -> bytes:
    parts = [task.session_id.encode(), b"\0", task.decode_worker.encode(), b"\0",
             struct.pack("<IIII", task.round, task.l_hist, task.l_incr, task.decode_tp)]
    for segs in (task.history if history is None else history, task.dest if dest is None else dest):
        # one pack per list, not one a segment: the same bytes, in half the time (every remote
        # prefill is checked against its token on its path)
        flat: list[int] = []
        add = flat.extend
        for s in segs:
            add((s.block, s.offset, s.tokens))
        parts.append(struct.pack(f"<I{len(flat)}I", len(segs), *flat))
    if task.history_on_host:  # the history's segments are the host pool's: covered, or a prefill
        parts.append(b"\0host")  # worker could be sent to read device blocks as if they were host ones
    return b"".join(parts)


def task_token(key: bytes, task: common_pb2.PrefillTask, history: Sequence | None = None,
               dest: Sequence | None = None) -> str:
    """The token of ``task`` under ``key`` (its ``task_token`` field is not covered). ``history`` and
    ``dest``: the task's segments as the caller already holds them (``ampd.kv.Segment``), the same
    as the message's: reading a message's repeated field costs several times more."""
    return hmac.digest(key, _task_message(task, history, dest), "sha256").hex()[:32]


def attach_token(task_key: bytes, session_id: str, decode_worker: str, secret: str) -> str:
    """The attach token of a session on ``decode_worker`` (AttachRequest.attach_token). Its key is
    derived from the task key, so that no attach token is ever a valid task token or the reverse."""
    key = hmac.digest(task_key, b"ampd attach token", "sha256")
    msg = b"\0".join((session_id.encode(), decode_worker.encode(), secret.encode()))
    return hmac.digest(key, msg, "sha256").hex()[:32]


def reattach_token(secret: str) -> str:
    """The client's credential to reattach its session through another coordinator
    (SessionEvent.reattach_token): derived from the session secret, which the client never sees and
    every coordinator reads from the session's record in Redis."""
    return hmac.digest(secret.encode(), b"ampd reattach token", "sha256").hex()[:32]


def token_matches(expected: str, given: str) -> bool:
    """Constant-time comparison (an empty expected value matches nothing)."""
    return bool(expected) and hmac.compare_digest(expected.encode(), given.encode())


def redacted(url: str) -> str:
    """``url`` with its password (``redis://user:PASSWORD@host``) replaced by ``***``, for logs."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
