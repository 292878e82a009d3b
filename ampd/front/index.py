"""The fronts' shared index of live sessions' token histories, in Redis.

Everything is scoped to a tenant (`tenant_scope`: a hash of its name, the same idea as vLLM's and
SGLang's `cache_salt`): a history's digest is salted with the scope, and the other keys carry it, so
a tenant's request never matches, nor learns of, another tenant's session.

Keys (prefix `{ns}:front`):
- `hist:{digest}`           the idle session whose history has this (salted) digest (`history_entry`):
                            JSON {sid, name, front}
- `lengths:{scope}`         hash: history length -> how many of the tenant's indexed histories have it
                            (the lengths a request's prefix is tried at); a length's field goes when its
                            count reaches 0, and the hash with its last field
- `session:{sid}`           hash of one session a front holds: front (its URL), history (packed uint32
                            ids), digest, updated (unix seconds)
- `answer:{scope}:{digest}` hash: session id -> the ids that session holds for one answer
                            (`answer_digest`), packed uint32. A session holds a field for every answer in
                            its history (its own and those it was opened with), so an answer's ids live as
                            long as some session whose history has them

A session is indexed by the history it holds while it idles between turns. While a turn runs its
entry stays in Redis (the front that holds it knows it is busy; a request forwarded to a busy
session opens a new one there), and the turn's end replaces it with the new history: one round
trip per turn. Closing a session takes out every key it owns (`withdraw`). Every key also expires
after the session TTL plus a margin, so a front that dies leaves nothing behind for long.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import redis.asyncio as aioredis

__all__ = ["SessionIndex", "LocalIndex", "Match", "pack", "unpack", "prefix_digests", "history_entry", "HistoryEntry",
           "tenant_scope"]


_LITTLE = sys.byteorder == "little"
assert array.array("I").itemsize == 4

# Decrements a length's count and deletes the field at 0 (the hash goes with its last field): a
# front's Redis keys all go when its sessions do.
_DECR = ("local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -1) "
         "if n <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end return n")


def tenant_scope(tenant: str) -> str:
    """The scope of a tenant's sessions in the index: a hash of its name (names stay out of Redis)."""
    return hashlib.sha256(b"ampd-tenant\0" + tenant.encode()).hexdigest()[:16]


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
    name: str = ""  # the session's name for its client (what x-session-id carries)


class SessionIndex:
    def __init__(self, client: aioredis.Redis, namespace: str, ttl_s: float) -> None:
        self.r = client
        self.p = f"{namespace}:front"
        self.ttl_ms = int((ttl_s + 60.0) * 1000)

    async def prefetch(self, scope: str, answers: Sequence[str]) -> tuple[list[int], dict[str, list[int]]]:
        """The tenant's history lengths indexed now (descending) and the known ids of its ``answers``
        digests: what rendering a conversation and `find` need. One round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(f"{self.p}:lengths:{scope}")
        for d in answers:
            pipe.hvals(f"{self.p}:answer:{scope}:{d}")
        got = await pipe.execute()
        known = {d: unpack(vals[0]) for d, vals in zip(answers, got[1:]) if vals}
        lengths = sorted((int(k) for k, v in got[0].items() if int(v) > 0), reverse=True)
        return lengths, known

    async def find(self, scope: str, ids: Sequence[int], lengths: Sequence[int]) -> Match | None:
        """The tenant's idle session with the longest history that is a proper prefix of ``ids``,
        among histories of ``lengths``. One round trip (none when no length fits)."""
        lengths = [n for n in lengths if 0 < n < len(ids)]
        if not lengths:
            return None
        digests = prefix_digests(ids, lengths, scope)
        raws = await self.r.mget([f"{self.p}:hist:{d}" for d in digests])
        for n, raw in zip(lengths, raws):
            if raw:
                rec = json.loads(raw)
                return Match(rec["sid"], rec["front"], n, rec.get("name", rec["sid"]))
        return None

    async def publish(self, sid: str, name: str, front: str, entry: "HistoryEntry",
                      answers: Iterable[tuple[str, Sequence[int]]] = (), stale: tuple[str, int] | None = None
                      ) -> None:
        """Indexes the idle session: its history (``entry``, from `history_entry`) and the answers
        (digest, ids) its history gained, in place of its ``stale`` entry (the history its turn
        started from). One round trip."""
        ttl, scope = self.ttl_ms, entry.scope
        lengths = f"{self.p}:lengths:{scope}"
        pipe = self.r.pipeline(transaction=False)
        if stale:
            pipe.delete(f"{self.p}:hist:{stale[0]}")
            pipe.eval(_DECR, 1, lengths, str(stale[1]))
        pipe.set(f"{self.p}:hist:{entry.digest}", json.dumps({"sid": sid, "name": name, "front": front}), px=ttl)
        pipe.hincrby(lengths, str(entry.length), 1)
        pipe.pexpire(lengths, ttl)
        pipe.hset(f"{self.p}:session:{sid}", mapping={"front": front, "history": entry.packed, "digest": entry.digest,
                                                     "updated": time.time()})
        pipe.pexpire(f"{self.p}:session:{sid}", ttl)
        for d, ids in answers:
            key = f"{self.p}:answer:{scope}:{d}"
            pipe.hset(key, sid, pack(ids))
            pipe.pexpire(key, ttl)
        await pipe.execute()

    async def withdraw(self, scope: str, entry: tuple[str, int] | None, sid: str | None = None,
                       answers: Iterable[str] = ()) -> None:
        """Takes a session's index entry out (a turn runs on it), and with ``sid`` its record and
        its fields of ``answers`` (it closed)."""
        pipe = self.r.pipeline(transaction=False)
        if entry:
            pipe.delete(f"{self.p}:hist:{entry[0]}")
            pipe.eval(_DECR, 1, f"{self.p}:lengths:{scope}", str(entry[1]))
        if sid:
            pipe.delete(f"{self.p}:session:{sid}")
            for d in answers:
                pipe.hdel(f"{self.p}:answer:{scope}:{d}", sid)
        await pipe.execute()

    async def history(self, sid: str) -> list[int] | None:
        raw = await self.r.hget(f"{self.p}:session:{sid}", "history")
        return unpack(raw) if raw is not None else None

    async def live_sessions(self) -> list[str]:
        """Session ids any front has recorded (tests: nothing leaks)."""
        keys = [k async for k in self.r.scan_iter(match=f"{self.p}:session:*")]
        return [(k.decode() if isinstance(k, bytes) else k).rsplit(":", 1)[1] for k in keys]

    async def keys(self) -> list[str]:
        """Every key the fronts hold now (tests: none outlives its session)."""
        return sorted([(k.decode() if isinstance(k, bytes) else k) async for k in self.r.scan_iter(match=f"{self.p}:*")])


def _digest(data: bytes, scope: str) -> str:
    return hashlib.sha256(scope.encode() + b"\0" + data).hexdigest()[:32]


def prefix_digests(ids: Sequence[int], lengths: Sequence[int], scope: str) -> list[str]:
    """The digest of ids[:n] for each n in ``lengths`` (descending), hashing the ids once."""
    data = pack(ids)
    h = hashlib.sha256(scope.encode() + b"\0")
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
        self.sessions: dict[str, str] = {}  # history digest (salted) -> session id
        self.lengths: dict[str, dict[int, int]] = {}  # scope -> history length -> how many
        self.answers: dict[tuple[str, str], list[int]] = {}  # (scope, answer digest) -> its ids
        self._holders: dict[tuple[str, str], int] = {}  # (scope, answer digest) -> sessions holding it

    def add(self, sid: str, entry: "HistoryEntry") -> None:
        self.sessions[entry.digest] = sid
        counts = self.lengths.setdefault(entry.scope, {})
        counts[entry.length] = counts.get(entry.length, 0) + 1

    def remove(self, scope: str, entry: tuple[str, int]) -> None:
        if self.sessions.pop(entry[0], None) is not None:
            counts = self.lengths.get(scope, {})
            n = counts.get(entry[1], 0) - 1
            if n > 0:
                counts[entry[1]] = n
            else:
                counts.pop(entry[1], None)
                if not counts:
                    self.lengths.pop(scope, None)

    def hold_answer(self, scope: str, digest: str, ids: list[int]) -> None:
        """One more session holds the answer in its history."""
        self.answers[(scope, digest)] = ids
        self._holders[(scope, digest)] = self._holders.get((scope, digest), 0) + 1

    def release_answer(self, scope: str, digest: str) -> None:
        n = self._holders.get((scope, digest), 0) - 1
        if n > 0:
            self._holders[(scope, digest)] = n
        else:
            self._holders.pop((scope, digest), None)
            self.answers.pop((scope, digest), None)

    def find(self, scope: str, ids: Sequence[int]) -> Match | None:
        lengths = sorted((n for n in self.lengths.get(scope, ()) if 0 < n < len(ids)), reverse=True)
        if not lengths:
            return None
        for n, d in zip(lengths, prefix_digests(ids, lengths, scope)):
            if d in self.sessions:
                return Match(self.sessions[d], "", n)
        return None


@dataclass(frozen=True)
class HistoryEntry:
    """A history as the index keeps it: packed once, digested once (salted with its tenant's scope)."""
    packed: bytes
    digest: str
    length: int
    scope: str = ""

    @property
    def key(self) -> tuple[str, int]:  # what `withdraw` and `LocalIndex.remove` take
        return self.digest, self.length


def history_entry(history: Sequence[int], scope: str) -> HistoryEntry:
    packed = pack(history)
    return HistoryEntry(packed, _digest(packed, scope), len(history), scope)
