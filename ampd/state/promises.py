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
"""
from __future__ import annotations

import hashlib

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

__all__ = ["Promises"]

_PROMISE = """
local cap = tonumber(ARGV[3])
if cap > 0 and tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') + tonumber(ARGV[2]) > cap then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], 'promised_on', ARGV[1])
redis.call('HINCRBY', KEYS[2], 'promised', ARGV[2])
return 1
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


class Promises:
    def __init__(self, r: aioredis.Redis, namespace: str = "ampd") -> None:
        self.r = r
        self.ns = namespace
        self.key = f"{namespace}:promised"

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

    async def promise(self, sid: str, worker: str, tokens: int, capacity: int = 0) -> bool:
        """Promises ``tokens`` on ``worker`` to session ``sid`` unless the worker's total would pass
        ``capacity`` (0: no bound); True when promised."""
        return bool(await self._run(_PROMISE, (self.key, self._session(sid)), worker, int(tokens), int(capacity)))

    async def add(self, sid: str, worker: str, tokens: int) -> None:
        """A later turn's KV (an accepted session is never refused): no bound."""
        await self.promise(sid, worker, tokens, 0)

    async def release(self, sid: str, delete_record: bool = False) -> int:
        """Frees the session's promise (and deletes its record): the tokens it held."""
        return int(await self._run(_RELEASE, (self.key, self._session(sid)), "1" if delete_record else "0"))
