"""The fronts' shared index of live sessions' token histories, in Redis.

Keys (prefix `{ns}:front`):
- `hist:{digest}`     the idle session whose history has this digest (`history_entry`): JSON {sid, front}
- `lengths`           hash: history length -> how many indexed histories have it (the lengths a
                      request's prefix is tried at)
- `session:{sid}`     hash of one session a front holds: front (its URL), history (packed uint32 ids),
                      digest, updated (unix seconds)
- `answer:{digest}`   the ids a session holds for one answer (`answer_digest`), packed uint32

A session is indexed by the history it holds while it idles between turns. While a turn runs its
entry stays in Redis (the front that holds it knows it is busy; a request forwarded to a busy
session opens a new one there), and the turn's end replaces it with the new history: one round
trip per turn. Closing a session takes its keys out. Every key expires after the session TTL (plus a margin), so a front that dies
leaves nothing behind for long.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import redis.asyncio as aioredis

__all__ = ["SessionIndex", "LocalIndex", "Match", "pack", "unpack", "prefix_digests", "history_entry", "HistoryEntry"]


_LITTLE = sys.byteorder == "little"
assert array.array("I").itemsize == 4


def pack(ids: Sequence[int]) -> bytes:
    """Little-endian uint32 ids. `array` over numpy: a front packs a whole resent history per
    turn, and numpy's conversion of a list is three times slower."""
    a = array.array("I", ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack(raw: bytes | None) -> list[int]:
    if not raw:
        return []
    a = array.array("I", raw)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


@dataclass(frozen=True)
class Match:
    session_id: str
    front: str  # the URL of the front that holds the session's stream
    length: int  # history tokens: ids[:length] is the session's history


class SessionIndex:
    def __init__(self, client: aioredis.Redis, namespace: str, ttl_s: float) -> None:
        self.r = client
        self.p = f"{namespace}:front"
        self.ttl_ms = int((ttl_s + 60.0) * 1000)

    async def prefetch(self, answers: Sequence[str]) -> tuple[list[int], dict[str, list[int]]]:
        """The history lengths indexed now (descending) and the known ids of the ``answers``
        digests: what rendering a conversation and `find` need. One round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(f"{self.p}:lengths")
        if answers:
            pipe.mget([f"{self.p}:answer:{d}" for d in answers])
        got = await pipe.execute()
        known = {d: unpack(raw) for d, raw in zip(answers, got[1] if answers else ()) if raw}
        lengths = sorted((int(k) for k, v in got[0].items() if int(v) > 0), reverse=True)
        return lengths, known

    async def find(self, ids: Sequence[int], lengths: Sequence[int]) -> Match | None:
        """The idle session with the longest history that is a proper prefix of ``ids``, among
        histories of ``lengths``. One round trip (none when no length fits)."""
        lengths = [n for n in lengths if 0 < n < len(ids)]
        if not lengths:
            return None
        digests = prefix_digests(ids, lengths)
        raws = await self.r.mget([f"{self.p}:hist:{d}" for d in digests])
        for n, raw in zip(lengths, raws):
            if raw:
                rec = json.loads(raw)
                return Match(rec["sid"], rec["front"], n)
        return None

    async def publish(self, sid: str, front: str, entry: "HistoryEntry", answer: tuple[str, Sequence[int]] | None,
                      stale: tuple[str, int] | None = None) -> None:
        """Indexes the idle session: its history (``entry``, from `history_entry`) and last answer,
        in place of its ``stale`` entry (the history its turn started from). One round trip."""
        pipe = self.r.pipeline(transaction=False)
        if stale:
            pipe.delete(f"{self.p}:hist:{stale[0]}")
            pipe.hincrby(f"{self.p}:lengths", str(stale[1]), -1)
        pipe.set(f"{self.p}:hist:{entry.digest}", json.dumps({"sid": sid, "front": front}), px=self.ttl_ms)
        pipe.hincrby(f"{self.p}:lengths", str(entry.length), 1)
        pipe.hset(f"{self.p}:session:{sid}", mapping={"front": front, "history": entry.packed, "digest": entry.digest,
                                                     "updated": time.time()})
        pipe.pexpire(f"{self.p}:session:{sid}", self.ttl_ms)
        if answer is not None:
            pipe.set(f"{self.p}:answer:{answer[0]}", pack(answer[1]), px=self.ttl_ms)
        await pipe.execute()

    async def withdraw(self, entry: tuple[str, int] | None, sid: str | None = None) -> None:
        """Takes a session's index entry out (a turn runs on it), and with ``sid`` its record (it closed)."""
        pipe = self.r.pipeline(transaction=False)
        if entry:
            pipe.delete(f"{self.p}:hist:{entry[0]}")
            pipe.hincrby(f"{self.p}:lengths", str(entry[1]), -1)
        if sid:
            pipe.delete(f"{self.p}:session:{sid}")
        await pipe.execute()

    async def history(self, sid: str) -> list[int] | None:
        raw = await self.r.hget(f"{self.p}:session:{sid}", "history")
        return unpack(raw) if raw is not None else None

    async def live_sessions(self) -> list[str]:
        """Session ids any front has recorded (tests: nothing leaks)."""
        keys = [k async for k in self.r.scan_iter(match=f"{self.p}:session:*")]
        return [(k.decode() if isinstance(k, bytes) else k).rsplit(":", 1)[1] for k in keys]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def prefix_digests(ids: Sequence[int], lengths: Sequence[int]) -> list[str]:
    """The digest of ids[:n] for each n in ``lengths`` (descending), hashing the ids once."""
    data = pack(ids)
    h = hashlib.sha256()
    out: dict[int, str] = {}
    pos = 0
    for n in sorted(lengths):
        h.update(data[pos * 4:n * 4])
        pos = n
        out[n] = h.copy().hexdigest()[:32]
    return [out[n] for n in lengths]


class LocalIndex:
    """The same index over the sessions one front holds, in its memory: the front that holds a
    session finds it without a Redis round trip (the shared index is for the others)."""

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}  # history digest -> session id
        self.lengths: dict[int, int] = {}  # history length -> how many
        self.answers: dict[str, list[int]] = {}  # answer digest -> its ids

    def add(self, sid: str, entry: tuple[str, int]) -> None:
        self.sessions[entry[0]] = sid
        self.lengths[entry[1]] = self.lengths.get(entry[1], 0) + 1

    def remove(self, entry: tuple[str, int]) -> None:
        if self.sessions.pop(entry[0], None) is not None:
            n = self.lengths.get(entry[1], 0) - 1
            if n > 0:
                self.lengths[entry[1]] = n
            else:
                self.lengths.pop(entry[1], None)

    def find(self, ids: Sequence[int]) -> Match | None:
        lengths = sorted((n for n in self.lengths if 0 < n < len(ids)), reverse=True)
        if not lengths:
            return None
        for n, d in zip(lengths, prefix_digests(ids, lengths)):
            if d in self.sessions:
                return Match(self.sessions[d], "", n)
        return None


@dataclass(frozen=True)
class HistoryEntry:
    """A history as the index keeps it: packed once, digested once."""
    packed: bytes
    digest: str
    length: int

    @property
    def key(self) -> tuple[str, int]:  # what `withdraw` and `LocalIndex` take
        return self.digest, self.length


def history_entry(history: Sequence[int]) -> HistoryEntry:
    packed = pack(history)
    return HistoryEntry(packed, _digest(packed), len(history))
