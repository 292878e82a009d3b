"""The Redis schema every service shares.

Keys (prefix `ns`, default "ampd"). The three hashes have no TTL: each worker deletes its own
fields when it stops (deregister_worker), and a coordinator removes those of a worker whose liveness
key has been gone a while. Every other key has a TTL or is deleted by its owner
(tests/integration/test_redis_keys.py).
- `{ns}:workers`        hash worker_id -> WorkerInfo JSON (static: address, kind, tp, KV layout, sidecar)
- `{ns}:nixl`           hash worker_id -> NIXL agent metadata (bytes)
- `{ns}:stats`          hash worker_id -> WorkerStats JSON (published on every queue change and at
                        least every `heartbeat_s`)
- `{ns}:alive:{wid}`    a worker's liveness key (its value: the heartbeat's time, so each heartbeat
                        changes it): set with a TTL (`liveness_ttl`) by every heartbeat,
                        so it expires on its own when the worker dies; routing reads only workers
                        whose key exists (and the coordinator drops one at once when a call to it
                        fails on the connection)
- `{ns}:fence:{wid}`    a fence (docs/deploy.md "Faults"): the epoch of a registration that a coordinator
                        revoked because the worker went unheard for `fence_after`; the worker, when it
                        resumes, sees it at its next heartbeat, drops its sessions and registers with a
                        newer epoch (deleting it). A TTL (FENCE_KEEP_S) bounds it when none resumes
- `{ns}:session:{sid}`  hash of one live session (its binding, secret and KV promise, its coordinator,
                        the round it was bound at); deleted
                        when it ends, or by any coordinator once its own coordinator is gone
- `{ns}:promised`       hash decode worker -> KV tokens promised to live sessions by every coordinator;
                        each session's share is in its record (ampd.state.promises)
- `{ns}:prefix:{wid}`   the prefix blocks a decode worker holds (--prefix-sharing; ampd.state.prefixes):
                        a TTL renewed by the worker, deleted when it deregisters
- `{ns}:coordinator:{id}` a coordinator's liveness key (TTL, renewed every poll; deleted when it
                        stops): the owner of the session records that name it
- channel `{ns}:stats`  every stats publish is also PUBLISHed here (same JSON), so a coordinator can
                        keep the cluster view in memory instead of reading it per decision

Routing needs every worker's stats, so they live in ONE hash: one HGETALL per decision (the
`read` mode), or none at all when the coordinator follows the channel (the `push` mode).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from ampd.policy import PrefillTask, WorkerView
from ampd.state.url import parse as parse_redis_url
from ampd.state.url import pool as redis_pool
from ampd.state.url import unreachable
from ampd.state.promises import Promises

# A worker's publication (StateStore.heartbeat) as one script: its stats into the hash and the
# channel and its liveness key renewed, only while it is registered (else 0, and nothing written: a
# publication still on its way when the worker deregistered must not bring back its keys). Workers publish on every
# queue change, several times a round: as a 4-command pipeline, redis-py's packing and parsing took
# ~350 us of the worker's CPU a publication, as one EVALSHA ~100 us.
# A fenced registration (its epoch at or below the fence) publishes nothing and returns -1. The
# liveness key's value is the publication's time: a coordinator sees each heartbeat as a change of it.
_HEARTBEAT = """
local fence = redis.call('GET', KEYS[4])
if fence and tonumber(fence) >= tonumber(ARGV[4]) then return -1 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', KEYS[1], ARGV[2])
redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[3])
return 1
"""
_HEARTBEAT_SHA = hashlib.sha1(_HEARTBEAT.encode()).hexdigest()
# A coordinator's fence, atomic: revokes the registration of epoch ARGV[2] (none newer may have
# replaced it meanwhile: a restarted worker's is left alone) and leaves the fence marker.
_FENCE = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  local ok, info = pcall(cjson.decode, raw)
  if ok and tonumber(info['epoch'] or 0) ~= tonumber(ARGV[2]) then return 0 end
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
redis.call('SET', KEYS[5], ARGV[2], 'PX', ARGV[3])
return 1
"""
# How long a fence marker outlives a worker that never resumes. One that resumes later finds its
# sessions' streams cancelled by the coordinator anyway (it frees them), and registers again.
FENCE_KEEP_S = 3600.0
# heartbeat's answers
REGISTERED, UNREGISTERED, FENCED = 1, 0, -1

# What a lost or restarting Redis raises (redis-py wraps most of them; a refused connect can be OSError).
REDIS_ERRORS = (aioredis.ConnectionError, aioredis.TimeoutError, ConnectionError, OSError)


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    kind: str  # "prefill" | "decode"
    address: str
    tp: int
    nixl_agent: str
    layout: dict  # ampd.kv.PoolLayout.to_dict()
    kv_capacity_tokens: int
    sidecar: str = ""
    engine: str = "mock"
    profile: str = ""
    task_key: str = ""  # hex; a decode worker's key of its prefill tasks' tokens (ampd.trust)
    # The registration's fencing epoch (microseconds at registration, above any fence of this id):
    # a coordinator's fence names the epoch it revokes (StateStore.fence)
    epoch: int = 0
    # A decode worker's host KV tier, in tokens (--kv-host-mb; 0: none): admission promises it
    # beyond kv_capacity_tokens, as far as idle KV can be on host (ampd.policy.admit.promise_room)
    kv_host_tokens: int = 0
    # --prefix-sharing on this decode worker: it publishes the hashes of the prefix blocks it holds
    # (ampd.state.prefixes), chained from this seed (its model's: ampd.policy.prefixbind.prefix_seed)
    prefix_sharing: bool = False
    prefix_seed: int = 0
    # A decode worker's host KV tier as a NIXL peer: its agent's name, metadata (base64) and pool
    # layout, so that a prefill worker reads a round's history from the host copy (PrefillTask
    # .history_on_host). In the registration, so that it comes and goes with it. Empty: no tier.
    host_agent: str = ""
    host_metadata: str = ""
    host_layout: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "WorkerInfo":
        return cls(**_known(json.loads(raw), _INFO_FIELDS))


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    ts: float  # publish time (unix)
    window_mean_s: float | None  # windowed TTFT (prefill) or ITL (decode)
    queue: tuple[tuple[str, int, int, int, float], ...]  # (session, round, l_hist, l_incr, enqueued_at)
    queue_predicted_s: float  # queued tasks + the remaining time of the one in service, as of ts
    kv_free_tokens: int
    active_sessions: int = 0
    extra: dict = field(default_factory=dict)
    busy_until: float = 0.0  # predicted end (unix) of the prefill in service; 0: none
    # The last prefill tasks the worker took, (session, round), oldest first: a task the coordinator
    # routed counts in its view of the worker until this shows it (Cluster.routed).
    accepted: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> str:
        # its fields as they are (json writes tuples as lists): asdict's deep copy is a third of the
        # cost, and a worker publishes several times a round
        return json.dumps(vars(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "WorkerStats":
        d = json.loads(raw)
        d["queue"] = tuple(tuple(q) for q in d["queue"])
        if "accepted" in d:
            d["accepted"] = tuple(tuple(a) for a in d["accepted"])
        return cls(**_known(d, _STATS_FIELDS))

    def view(self, kind: str, tp: int) -> WorkerView:
        return WorkerView(
            worker_id=self.worker_id,
            kind=kind,
            tp=tp,
            window_mean_s=self.window_mean_s,
            queue=tuple(PrefillTask(*q) for q in self.queue),
            kv_free_tokens=self.kv_free_tokens,
            queue_predicted_s=self.queue_predicted_s,
        )


_INFO_FIELDS = frozenset(f.name for f in fields(WorkerInfo))
_STATS_FIELDS = frozenset(f.name for f in fields(WorkerStats))


async def _as_is(message):
    return message


def _known(d: dict, names: frozenset[str]) -> dict:
    """``d`` without the fields a newer worker added that this version does not know: a service
    swapped in before or after the others reads what it can."""
    return d if d.keys() <= names else {k: v for k, v in d.items() if k in names}


def age_view(v: WorkerView, ts: float, busy_until: float, now: float) -> WorkerView:
    """``v`` (published at ``ts``) as of ``now``: the remaining time of the prefill in service,
    part of ``queue_predicted_s``, has shrunk by the time since ``ts``. A worker republishes on
    every queue change but otherwise only every heartbeat (0.5 s), so without this a router would
    see a long prefill's remaining time up to a heartbeat too high."""
    if busy_until <= ts or now <= ts:
        return v
    return replace(v, queue_predicted_s=max(0.0, v.queue_predicted_s - (min(now, busy_until) - ts)))


# A process's Redis connections: at most POOL_CONNECTIONS; a call that finds none free waits up to
# POOL_WAIT_S for one, then fails with ConnectionError (retryable: the front answers 503). redis-py's
# default pool raises MaxConnectionsError at once past 100 connections, which a burst of 150 new
# chats turned into HTTP 500s (issue 24).
POOL_CONNECTIONS = 64
POOL_WAIT_S = 5.0
# Two more tries, on fresh connections, of a call that met a closed one (timeouts are not retried:
# a Redis that does not answer fails the call within socket_timeout).
RECONNECT = Retry(ExponentialBackoff(cap=0.2, base=0.02), 2)


async def connect(url: str, timeout_s: float = 10.0) -> aioredis.Redis:
    """Connects to Redis (``url``: one Redis, or Sentinels that name the master; ampd.state.url),
    retrying while it starts (a fresh `ampd up` races its redis-server). ConfigError, one line naming
    the address, when ``url`` is malformed or nothing answers within ``timeout_s``."""
    target = parse_redis_url(url)
    # Timeouts: a Redis that stops answering must fail a call (and let the caller's backoff run),
    # never hang it. A connection error is retried on a fresh connection: after a Redis restart
    # (or a Sentinel failover) every pooled connection is closed by the server, and without this
    # each of them failed one call (a coordinator lost a session record that way).
    client = aioredis.Redis.from_pool(redis_pool(target, max_connections=POOL_CONNECTIONS, wait_s=POOL_WAIT_S,
                                                 decode_responses=False, socket_timeout=5.0,
                                                 socket_connect_timeout=2.0, retry=RECONNECT,
                                                 retry_on_error=[aioredis.ConnectionError]))
    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(REDIS_ERRORS),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            stop=stop_after_delay(timeout_s),
            reraise=True,
        ):
            with attempt:
                await client.ping()
    except REDIS_ERRORS + (aioredis.ResponseError,) as exc:
        await client.aclose()
        raise await unreachable(target, timeout_s, exc) from None
    return client


def registry_key(namespace: str) -> str:
    """The worker registry (worker id -> WorkerInfo): a worker's writes land only while it is in it."""
    return f"{namespace}:workers"


class StateStore:
    def __init__(self, client: aioredis.Redis, namespace: str = "ampd") -> None:
        self.r = client
        self.ns = namespace
        self.k_workers = registry_key(namespace)
        self.k_nixl = f"{namespace}:nixl"
        self.k_stats = f"{namespace}:stats"

    def session_key(self, session_id: str) -> str:
        return f"{self.ns}:session:{session_id}"

    def alive_key(self, worker_id: str) -> str:
        return f"{self.ns}:alive:{worker_id}"

    def fence_key(self, worker_id: str) -> str:
        return f"{self.ns}:fence:{worker_id}"

    # --- workers -------------------------------------------------------------------------------
    async def register_worker(self, info: WorkerInfo, nixl_metadata: bytes, stats: WorkerStats,
                              ttl_s: float) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.k_workers, info.worker_id, info.to_json())
            p.hset(self.k_nixl, info.worker_id, nixl_metadata)
            p.hset(self.k_stats, info.worker_id, stats.to_json())
            p.set(self.alive_key(info.worker_id), repr(stats.ts), px=max(1, int(ttl_s * 1000)))
            p.delete(self.fence_key(info.worker_id))  # this epoch is above it: the fence has done its work
            await p.execute()

    async def fence_epoch(self, worker_id: str) -> int:
        """The epoch fenced for ``worker_id`` (0: none); a new registration's must be above it."""
        raw = await self.r.get(self.fence_key(worker_id))
        return int(raw) if raw else 0

    async def fence(self, worker_id: str, epoch: int, keep_s: float = FENCE_KEEP_S) -> bool:
        """Revokes ``worker_id``'s registration of ``epoch`` (unless a newer one replaced it) and
        leaves a fence marker that worker sees when it resumes. True when it fenced."""
        keys = (self.k_workers, self.k_nixl, self.k_stats, self.alive_key(worker_id), self.fence_key(worker_id))
        return bool(await self.r.eval(_FENCE, len(keys), *keys, worker_id, int(epoch), int(keep_s * 1000)))

    async def deregister_worker(self, worker_id: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.delete(self.alive_key(worker_id))
            p.hdel(self.k_workers, worker_id)
            p.hdel(self.k_nixl, worker_id)
            p.hdel(self.k_stats, worker_id)
            p.delete(f"{self.ns}:prefix:{worker_id}")  # (ampd.state.prefixes.prefix_key)
            await p.execute()

    async def heartbeat(self, stats: WorkerStats, ttl_s: float, epoch: int = 0) -> int:
        """Publishes ``stats`` and renews the worker's liveness key, in one command (_HEARTBEAT).
        REGISTERED; UNREGISTERED when the worker is not registered (Redis restarted empty, or it
        left): register again; FENCED (nothing published) when a coordinator fenced its registration
        of ``epoch``: drop what it served and register anew."""
        wid = stats.worker_id
        args = (4, self.k_stats, self.k_workers, self.alive_key(wid), self.fence_key(wid),
                wid, stats.to_json(), max(1, int(ttl_s * 1000)), int(epoch), repr(stats.ts))
        try:
            answer = await self.r.execute_command("EVALSHA", _HEARTBEAT_SHA, *args)
        except NoScriptError:  # a Redis that has not run it yet (or restarted): EVAL caches it
            answer = await self.r.execute_command("EVAL", _HEARTBEAT, *args)
        return int(answer)

    async def liveness(self, worker_ids) -> dict[str, bytes]:
        """worker id -> its liveness key's value (its last heartbeat's time), for those whose key
        has not expired (one round trip)."""
        ids = list(worker_ids)
        if not ids:
            return {}
        found = await self.r.mget([self.alive_key(w) for w in ids])
        return {w: v for w, v in zip(ids, found) if v is not None}

    async def live_workers(self, worker_ids) -> set[str]:
        """Those of ``worker_ids`` whose liveness key has not expired (one round trip)."""
        ids = list(worker_ids)
        if not ids:
            return set()
        found = await self.r.mget([self.alive_key(w) for w in ids])
        return {w for w, v in zip(ids, found) if v is not None}

    async def publish_stats(self, stats: WorkerStats) -> None:
        raw = stats.to_json()
        async with self.r.pipeline(transaction=False) as p:  # one round trip
            p.hset(self.k_stats, stats.worker_id, raw)
            p.publish(self.k_stats, raw)
            await p.execute()

    def subscribe(self):
        """A pub/sub handle subscribed (on first use) to the stats channel."""
        # redis-py's default handler of a pub/sub message (hiredis gives each one as a push) formats
        # it into a debug line, logged or not: a string of the whole publication, every one
        return self.r.pubsub(ignore_subscribe_messages=True, push_handler_func=_as_is)

    async def workers(self) -> dict[str, WorkerInfo]:
        raw = await self.r.hgetall(self.k_workers)
        return {k.decode(): WorkerInfo.from_json(v) for k, v in raw.items()}

    async def nixl_metadata(self, worker_id: str) -> bytes | None:
        return await self.r.hget(self.k_nixl, worker_id)

    async def stats(self) -> dict[str, WorkerStats]:
        """Every worker's latest statistics: one round trip."""
        raw = await self.r.hgetall(self.k_stats)
        return {k.decode(): WorkerStats.from_json(v) for k, v in raw.items()}

    # --- sessions ------------------------------------------------------------------------------
    async def put_session(self, session_id: str, fields: dict[str, str | int | float]) -> None:
        await self.r.hset(self.session_key(session_id), mapping=fields)

    async def update_session(self, session_id: str, fields: dict[str, str | int | float]) -> None:
        await self.r.hset(self.session_key(session_id), mapping=fields)

    async def session_record(self, session_id: str) -> dict[str, str]:
        """A live session's record (empty: none)."""
        raw = await self.r.hgetall(self.session_key(session_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def delete_session(self, session_id: str) -> None:
        """Deletes the session's record and releases the KV promised to it (ampd.state.promises)."""
        await Promises(self.r, self.ns).release(session_id, delete_record=True)

    async def delete_sessions(self, session_ids) -> None:
        promises = Promises(self.r, self.ns)
        for sid in session_ids:
            await promises.release(sid, delete_record=True)

    def coordinator_key(self, instance: str) -> str:
        return f"{self.ns}:coordinator:{instance}"

    async def coordinator_alive(self, instance: str, ttl_s: float) -> None:
        await self.r.set(self.coordinator_key(instance), b"1", px=max(1, int(ttl_s * 1000)))

    async def coordinator_gone(self, instance: str) -> None:
        await self.r.delete(self.coordinator_key(instance))

    async def orphan_sessions(self) -> list[str]:
        """Ids of the session records whose coordinator is gone (it died serving them)."""
        keys = [k async for k in self.r.scan_iter(match=f"{self.ns}:session:*", count=1000)]
        if not keys:
            return []
        async with self.r.pipeline(transaction=False) as p:
            for k in keys:
                p.hget(k, "coordinator")
            owners = await p.execute()
        known = {o for o in owners if o}
        async with self.r.pipeline(transaction=False) as p:
            for o in known:
                p.exists(self.coordinator_key(o.decode()))
            alive = dict(zip(known, await p.execute()))
        prefix = len(f"{self.ns}:session:")
        return [k.decode()[prefix:] for k, o in zip(keys, owners) if not o or not alive.get(o)]

    async def session_keys(self) -> list[str]:
        return [k.decode() async for k in self.r.scan_iter(match=f"{self.ns}:session:*")]
