"""KV promised to live sessions, shared by every coordinator of a deployment (Redis).

Admission (services/coordinator/admission.py) promises each accepted session the KV it may need on
its decode worker. With several coordinators, each must see the others' promises, or two would
book the same free KV: the totals live in one hash, and each session's promise in its record, so
that whatever deletes a record (its session's end, or the sweep of a lost coordinator's records)
releases its promise in the same step.

Keys (ampd.state.store's schema):
- `{ns}:promised`        hash decode worker -> KV tokens promised there (a field at 0 is deleted)
- `{ns}:session:{sid}`   the session's record: `promised_on` (its worker) and `promised` (tokens)

A promise is made only if the worker's total stays within its capacity (checked and added in one
script): a coordinator that judged on totals read a moment before finds out there, and judges again.

A new session's record may already stand: its coordinator was lost before the client learnt the
session's reattach token, and the client opened it again through another coordinator
(ampd.coordinators). That record is stale once its coordinator's liveness key is gone: the new
session's promise releases its promise and replaces it, in the same script, and names the decode
worker holding the stale copy (and its secret) for the new coordinator to cancel it there, rather
than the copy holding its KV for `--reattach-grace` and its promise staying booked for good.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

__all__ = ["Promised", "Promises"]

# ARGV: worker, tokens, capacity (0: no bound), and for a new session the prefix of the coordinators'
# liveness keys ('' otherwise): a record already there whose coordinator is gone is stale
_PROMISE = """
local on, held, where, secret = false, 0, false, false
if ARGV[4] ~= '' then
  local old = redis.call('HMGET', KEYS[2], 'coordinator', 'promised_on', 'promised', 'decode_worker', 'secret')
  if (old[2] or old[4]) and not (old[1] and redis.call('EXISTS', ARGV[4] .. old[1]) == 1) then
    on, held, where, secret = old[2], tonumber(old[3] or '0'), old[4], old[5]
  end
end
local total = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if on == ARGV[1] then total = total - held end
local cap = tonumber(ARGV[3])
if cap > 0 and total + tonumber(ARGV[2]) > cap then return {0} end
if on and held ~= 0 then
  if redis.call('HINCRBY', KEYS[1], on, -held) <= 0 then redis.call('HDEL', KEYS[1], on) end
end
if on or where then redis.call('DEL', KEYS[2]) end
redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], 'promised_on', ARGV[1])
redis.call('HINCRBY', KEYS[2], 'promised', ARGV[2])
if where and secret and where ~= ARGV[1] then return {1, where, secret} end
return {1}
"""
# releases the record's promise; ARGV[1] == '1': deletes the record too
_RELEASE = """
local w = redis.call('HGET', KEYS[2], 'promised_on')
local n = tonumber(redis.call('HGET', KEYS[2], 'promised') or '0')
if w and n ~= 0 then
  if redis.call('HINCRBY', KEYS[1], w, -n) <= 0 then redis.call('HDEL', KEYS[1], w) end
end
if ARGV[1] == '1' then redis.call('DEL', KEYS[2]) else redis.call('HDEL', KEYS[2], 'promised_on', 'promised') end
return n
"""
_SHA = {s: hashlib.sha1(s.encode()).hexdigest() for s in (_PROMISE, _RELEASE)}


@dataclass(frozen=True)
class Promised:
    """A promise's answer: ``made`` or not (the worker's total would pass its capacity), and a stale
    copy of a new session, left by a lost coordinator on decode worker ``stale_on`` (secret
    ``stale_secret``): its record and promise are replaced, the copy is the caller's to cancel."""

    made: bool
    stale_on: str = ""
    stale_secret: str = ""


class Promises:
    def __init__(self, r: aioredis.Redis, namespace: str = "ampd", liveness_prefix: str = "") -> None:
        """``liveness_prefix``: the coordinators' liveness keys' (``StateStore.coordinator_key("")``);
        without it a new session's promise adds to a record already there, as a later turn's does."""
        self.r = r
        self.ns = namespace
        self.key = f"{namespace}:promised"
        self.liveness_prefix = liveness_prefix

    def _session(self, sid: str) -> str:
        return f"{self.ns}:session:{sid}"

    async def _run(self, script: str, keys: tuple, *args):
        try:
            return await self.r.evalsha(_SHA[script], len(keys), *keys, *args)
        except NoScriptError:  # not cached yet (or Redis restarted): EVAL caches it
            return await self.r.eval(script, len(keys), *keys, *args)

    async def totals(self) -> dict[str, int]:
        """decode worker -> KV tokens promised there, by every coordinator (one round trip)."""
        return {k.decode(): int(v) for k, v in (await self.r.hgetall(self.key)).items()}

    async def promise(self, sid: str, worker: str, tokens: int, capacity: int = 0, new: bool = False) -> Promised:
        """Promises ``tokens`` on ``worker`` to session ``sid`` unless the worker's total would pass
        ``capacity`` (0: no bound). ``new``: the session's first promise (a stale record is replaced:
        the module doc)."""
        out = await self._run(_PROMISE, (self.key, self._session(sid)), worker, int(tokens), int(capacity),
                              self.liveness_prefix if new else "")
        if len(out) == 3:
            return Promised(bool(out[0]), out[1].decode(), out[2].decode())
        return Promised(bool(out[0]))

    async def add(self, sid: str, worker: str, tokens: int) -> None:
        """A later turn's KV (an accepted session is never refused): no bound."""
        await self.promise(sid, worker, tokens, 0)

    async def release(self, sid: str, delete_record: bool = False) -> int:
        """Frees the session's promise (and deletes its record): the tokens it held."""
        return int(await self._run(_RELEASE, (self.key, self._session(sid)), "1" if delete_record else "0"))
