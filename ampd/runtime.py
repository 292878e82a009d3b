"""Plumbing every worker (prefill and decode) shares: KV pool + NIXL, Redis registration,
statistics publishing, peer discovery. The decisions stay in ampd.policy; this only adapts."""
from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import structlog

from ampd.config import SERVICE_SETTINGS, ConfigError, add_flags, inherit, inherited, pool_prefix_sharing, require
from ampd.deployment import check_names
from ampd.engine import capabilities_of
from ampd.engine.base import Sampling
from ampd.kv import KVPool, PoolLayout
from ampd.kv.finetimer import fine_sleep
from ampd.perf import Profile
from ampd.policy import WorkerView
from ampd.state import StateStore, WorkerInfo, WorkerStats
from ampd.state.store import FENCED, REDIS_ERRORS, REGISTERED
from ampd.trust import new_key
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

log = structlog.get_logger()

# The shortest gap between two publications of a worker's statistics. A worker publishes on every
# change of its queue, KV or window, which comes several times within a millisecond around a
# prefill (its start and end, the first decode steps): every publication costs the worker, Redis
# and every coordinator (which parses it) ~0.3 ms of CPU together. Measured here, a round of the
# zero-cost path made ~5 publications at no gap and ~3 at this one; a busy decode worker's steps
# (10 ms or more) still publish one each.
PUBLISH_MIN_GAP_S = 2e-3
# How long a change waits before it is published: the work that made it (the round's next hops, on
# this worker's loop and on the box's cores) goes first; a router reading the view meanwhile sees
# it this much later.
PUBLISH_DELAY_S = 1e-3
# The longest a publication waits for an urgent section (WorkerRuntime.urgent) to end: as stale
# as PUBLISH_MIN_GAP_S lets statistics be anyway. A prefill worker's task is urgent from its start
# to its notification (~1.5 ms on the zero-cost path): a publication in the middle of it put
# ~0.2 ms of CPU (snapshot, JSON, the Redis call and its reply) between its transfer polls.
PUBLISH_HOLD_S = PUBLISH_MIN_GAP_S
# How many of the tasks a worker took last its statistics name (WorkerStats.accepted): more than
# are ever taken between two publications, which are at most a heartbeat apart and come on every
# queue change.
ACCEPTED_KEPT = 8

@dataclass(frozen=True)
class WorkerConfig:
    """One worker's settings, resolved (kind and bound port known). Built by ``worker_config`` from
    the flags ampd.config derives; every field but ``kind`` and ``port`` holds the ampd.config
    setting its ``inherit`` names, with that setting's default (the ``_s`` fields are in seconds)."""

    kind: str  # "prefill" | "decode"
    port: int  # the port bound (--port may be 0)
    worker_id: str = inherit("worker_id")
    host: str = inherit("host")
    advertise: str = inherit("advertise")  # address other services dial (worker_config: HOST:PORT when empty)
    redis_url: str = inherit("redis_url")
    namespace: str = inherit("namespace")
    profile: str = inherit("profile")
    tp: int = inherit("tp")
    engine: str = inherit("engine")
    model: str = inherit("model")  # a real engine's model
    policy: str = inherit("policy")
    ttft_slo_s: float = inherit("ttft_slo")
    itl_slo_s: float = inherit("itl_slo")
    window_s: float = inherit("stats_window")
    reorder_window: int = inherit("reorder_window")
    block_tokens: int = inherit("block_tokens")
    kv_bytes_per_token: int = inherit("kv_bytes_per_token")  # the mock's (the profile's are for timing)
    kv_pool_mb: int = inherit("kv_pool_mb")
    heartbeat_s: float = inherit("heartbeat")
    liveness_ttl_s: float = inherit("liveness_ttl")
    fence_after_s: float = inherit("fence_after")
    kv_overlap: bool = inherit("kv_overlap")
    kv_admission: str = inherit("kv_admission")  # "wait" | "fail"
    chunked_prefill: bool = inherit("chunked_prefill")  # decode workers only
    kv_evict: bool = inherit("kv_evict")  # decode workers only
    kv_host_ratio: float = inherit("kv_host_ratio")  # decode workers only (sized in services/decode/tiersize.py)
    kv_host_mb: float = inherit("kv_host_mb")
    kv_offload_pressure: float = inherit("kv_offload_pressure")
    kv_prefetch_early: bool = inherit("kv_prefetch_early")
    prefix_sharing: bool = inherit("prefix_sharing")  # decode workers only (services/decode/prefix.py)
    sidecar: str = inherit("sidecar")  # decode workers only


def pool_for(profile: Profile, cfg: WorkerConfig, engine=None) -> KVPool:
    """A pool sized like the profile's KV capacity, capped by the memory this process may use. A real
    engine (capability ``cuts_pool``) cuts it in its model's KV layout; the mock keeps
    ``kv_bytes_per_token`` bytes a token."""
    caps = engine.capabilities if engine is not None else None  # ampd.engine.capabilities
    bpt = engine.kv_bytes_per_token if caps and caps.model_kv_bytes else cfg.kv_bytes_per_token
    tokens = max(cfg.block_tokens, min(profile.kv_capacity_tokens(cfg.tp), cfg.kv_pool_mb * 2**20 // bpt))
    if caps and caps.cuts_pool:
        return engine.make_pool(tokens, cfg.block_tokens)
    return KVPool(max(1, tokens // cfg.block_tokens), cfg.block_tokens, bpt)


class WorkerRuntime:
    """Owns the pool, the NIXL agent, the Redis registration and the stats publisher."""

    def __init__(self, cfg: WorkerConfig, store: StateStore, pool: KVPool) -> None:
        from ampd.kv.transport import NixlTransport, bind_ucx_to

        bind_ucx_to(cfg.host)  # UCX listens where the worker's gRPC does, not on every interface
        self.cfg = cfg
        self.store = store
        self.pool = pool
        self.agent_name = f"{cfg.worker_id}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self.transport = NixlTransport(self.agent_name, pool)
        # What the worker publishes, from the worker core that the service drives (set before
        # start): its view at a time (window, queue, queue_predicted_s, free KV) and the predicted
        # end (unix time) of the prefill in service, 0 when none (the coordinator ages the view by it).
        self.published: Callable[[float], tuple[WorkerView, float]] | None = None
        self.active_sessions = 0
        self.extra: dict = {}
        self.accepted: collections.deque[tuple[str, int]] = collections.deque(maxlen=ACCEPTED_KEPT)
        self._dirty = asyncio.Event()
        self._urgent = 0  # urgent sections open (urgent())
        self._calm = asyncio.Event()  # set while none is open
        self._calm.set()
        self._published_at = 0.0  # monotonic time of the last publish
        self._tasks: list[asyncio.Task] = []
        self._peer_gen: dict[str, str] = {}  # worker_id -> nixl agent name loaded
        self.peers: dict[str, WorkerInfo] = {}  # the other kind's workers, as registered (sync_peers)
        self.task_key = new_key()  # a decode worker's key of its prefill tasks' tokens (ampd.trust)
        self._peer_missing: dict[str, int] = {}  # worker_id -> peer syncs in a row it was not registered
        self._sidecar = ""
        self.registrations = 0  # how often this worker (re-)registered: 1 + Redis restarts survived
        self.epoch = 0  # the registration's fencing epoch (WorkerInfo.epoch)
        self.fences = 0  # how often a coordinator fenced this worker out (it re-registered clean each time)
        # Called (no arguments) when a coordinator fenced this worker: the service drops every session
        # and task it holds, before the worker registers anew.
        self.on_fenced: Callable[[], Awaitable[None]] | None = None
        # Called (with the silence, seconds) when a heartbeat comes more than the liveness TTL after
        # the one before (the worker was stopped): its liveness key expired, so the coordinator may
        # have given its work to others even if it did not fence it.
        self.on_silent: Callable[[float], Awaitable[None]] | None = None
        # monotonic time of the last heartbeat tried (answered or not: a lost Redis is not silence):
        # a worker silent for its liveness TTL may have been routed around (``silent``)
        self.beat_at = time.monotonic()
        # A decode worker's host KV tier capacity in tokens (--kv-host-mb; 0: none), registered so
        # that the coordinators' admission promises it beyond the device pool (WorkerInfo)
        self.kv_host_tokens = 0
        # A decode worker's prefix-hash seed (--prefix-sharing; WorkerInfo.prefix_seed), and loops
        # the service adds (its prefix publisher): started with the heartbeat, stopped before deregistering
        self.prefix_seed = 0
        # A decode worker's host KV tier's NIXL agent (name, metadata, layout), registered so that
        # prefill workers read histories from the host copy (WorkerInfo.host_agent); None: no tier
        self.host_peer: tuple[str, bytes, dict] | None = None
        self.loops: list[Callable[[], Awaitable[None]]] = []

    def info(self, sidecar: str = "") -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.cfg.worker_id,
            kind=self.cfg.kind,
            address=self.cfg.advertise,
            tp=self.cfg.tp,
            nixl_agent=self.agent_name,
            layout=self.pool.layout.to_dict(),
            kv_capacity_tokens=self.pool.capacity_tokens,
            sidecar=sidecar,
            engine=self.cfg.engine,
            profile=self.cfg.profile,
            task_key=self.task_key.hex() if self.cfg.kind == "decode" else "",
            epoch=self.epoch,
            kv_host_tokens=self.kv_host_tokens,
            prefix_sharing=self.cfg.kind == "decode" and self.cfg.prefix_sharing,
            prefix_seed=self.prefix_seed,
            **_host_fields(self.host_peer),
        )

    def snapshot(self) -> WorkerStats:
        now = time.time()
        v, busy_until = self.published(now)
        return WorkerStats(
            worker_id=self.cfg.worker_id,
            ts=now,
            window_mean_s=v.window_mean_s,
            queue=tuple((t.session_id, t.round, t.l_hist, t.l_incr, t.enqueued_at) for t in v.queue),
            queue_predicted_s=v.queue_predicted_s,
            kv_free_tokens=v.kv_free_tokens,
            active_sessions=self.active_sessions,
            extra=self.extra,
            busy_until=busy_until if busy_until > now else 0.0,
            accepted=tuple(self.accepted),
        )

    async def register(self) -> None:
        # a new epoch each time, above any fence of this worker id (one fenced while it was away)
        fenced = await self.store.fence_epoch(self.cfg.worker_id)
        self.epoch = max(time.time_ns() // 1000, fenced + 1, self.epoch + 1)
        await self.store.register_worker(self.info(self._sidecar), self.transport.metadata(), self.snapshot(),
                                         self.cfg.liveness_ttl_s)
        self.registrations += 1

    def silent(self) -> float:
        """Seconds since this worker last tried a heartbeat, when that is longer than its liveness
        TTL (it was stopped: its key may have expired and the coordinator moved its work); else 0."""
        gap = time.monotonic() - self.beat_at
        return gap if gap > self.cfg.liveness_ttl_s else 0.0

    async def start(self, sidecar: str = "") -> None:
        self._sidecar = sidecar
        # Redis may be restarting just now (a supervisor restarts both): wait for it, within bounds.
        async for attempt in AsyncRetrying(retry=retry_if_exception_type(REDIS_ERRORS), reraise=True,
                                           wait=wait_exponential(multiplier=0.1, max=2.0),
                                           stop=stop_after_delay(30.0), before_sleep=_log_redis_retry):
            with attempt:
                await self.register()
        self._tasks.append(asyncio.create_task(self._publisher(), name="stats-publisher"))
        self._tasks.append(asyncio.create_task(self._peer_sync(), name="peer-sync"))
        self._tasks.extend(asyncio.create_task(loop(), name=getattr(loop, "__name__", "loop")) for loop in self.loops)

    def changed(self) -> None:
        """Marks the queue/KV/window as changed: the publisher pushes it to Redis promptly."""
        self._dirty.set()

    def took(self, session_id: str, rnd: int) -> None:
        """A prefill task joined this worker's queue: published in ``accepted`` (and as a change)."""
        self.accepted.append((session_id, rnd))
        self.changed()

    @contextlib.contextmanager
    def urgent(self):
        """A section of a request's path (the loop is its critical path): publications wait for
        its end, at most PUBLISH_HOLD_S."""
        self._urgent += 1
        self._calm.clear()
        try:
            yield
        finally:
            self._urgent -= 1
            if not self._urgent:
                self._calm.set()

    async def _publisher(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.cfg.heartbeat_s):
                    await self._dirty.wait()
            except TimeoutError:
                pass
            # The work that made the change (the prefill or token it belongs to) runs first: the
            # publish waits PUBLISH_DELAY_S, and an urgent section's end (at most PUBLISH_HOLD_S).
            # Changes within PUBLISH_MIN_GAP_S of the last publish wait for that gap and go out together.
            gap = self._published_at + PUBLISH_MIN_GAP_S - time.monotonic()
            await fine_sleep(max(gap, PUBLISH_DELAY_S))
            if not self._calm.is_set():
                try:
                    async with asyncio.timeout(PUBLISH_HOLD_S):
                        await self._calm.wait()
                except TimeoutError:
                    pass
            self._dirty.clear()
            self._published_at = time.monotonic()
            try:
                await self._heartbeat()
            except REDIS_ERRORS:
                self.beat_at = time.monotonic()
                # A lost Redis: retry with bounded backoff (the worker keeps serving meanwhile); once
                # it answers again, a restarted (empty) Redis gets this worker's registration back.
                async for attempt in AsyncRetrying(retry=retry_if_exception_type(REDIS_ERRORS), reraise=True,
                                                   wait=wait_exponential(multiplier=0.1, max=2.0),
                                                   before_sleep=self._redis_retry):
                    with attempt:
                        await self._heartbeat()

    async def _heartbeat(self) -> None:
        silence = self.silent()
        if silence and self.on_silent is not None:
            log.warning("silent past the liveness TTL (stopped?)", worker=self.cfg.worker_id, silent_s=round(silence, 1))
            await self._hook(self.on_silent, silence)
        answer = await self.store.heartbeat(self.snapshot(), self.cfg.liveness_ttl_s, self.epoch)
        self.beat_at = time.monotonic()
        if answer == REGISTERED:
            return
        if answer == FENCED:
            # A coordinator found this worker silent for --fence-after (it was stopped, or its host
            # hung) and moved or failed its sessions: drop them all, then register clean.
            self.fences += 1
            log.warning("fenced out by the coordinator; dropping every session and registering anew",
                        worker=self.cfg.worker_id, epoch=self.epoch)
            if self.on_fenced is not None:
                await self._hook(self.on_fenced)
        await self.register()
        log.info("registered again", worker=self.cfg.worker_id, registrations=self.registrations, epoch=self.epoch)

    async def _hook(self, hook, *args) -> None:
        self.beat_at = time.monotonic()  # the silence is handled: once
        try:
            await hook(*args)
        except Exception as exc:  # noqa: BLE001 - the heartbeat goes on whatever failed
            log.warning("dropping the fenced work failed", error=repr(exc))

    def _redis_retry(self, state) -> None:
        self.beat_at = time.monotonic()  # trying: a lost Redis is not this worker's silence
        _log_redis_retry(state)

    async def sync_peers(self) -> None:
        """Loads NIXL metadata of the other kind's workers (new or restarted ones)."""
        workers = await self.store.workers()
        for wid, info in workers.items():
            if info.kind == self.cfg.kind or self._peer_gen.get(wid) == info.nixl_agent:
                continue
            md = await self.store.nixl_metadata(wid)
            if md is None:
                continue
            try:
                old = self.peers.get(wid)
                if old is not None and old.host_agent and old.host_agent != info.host_agent:
                    self.transport.remove_peer(old.host_agent)  # it restarted: its old host tier is gone
                self.transport.add_peer(info.nixl_agent, md, PoolLayout.from_dict(info.layout))
                if info.host_agent:  # its host KV tier: histories are read from there too
                    self.transport.add_peer(info.host_agent, base64.b64decode(info.host_metadata),
                                            PoolLayout.from_dict(info.host_layout))
                self._peer_gen[wid] = info.nixl_agent
                self.peers[wid] = info
                log.info("nixl peer added", peer=wid, agent=info.nixl_agent)
            except Exception as exc:
                log.warning("nixl peer add failed", peer=wid, error=str(exc))
        # A peer leaves only after several syncs without it: a restarted Redis is empty until the
        # workers register again, and transfers in flight to a live peer must not lose it.
        for wid in list(self._peer_gen):
            if wid in workers:
                self._peer_missing.pop(wid, None)
                continue
            self._peer_missing[wid] = self._peer_missing.get(wid, 0) + 1
            if self._peer_missing[wid] >= 5:
                del self._peer_missing[wid]
                self.transport.remove_peer(self._peer_gen.pop(wid))
                gone = self.peers.pop(wid, None)
                if gone is not None and gone.host_agent:
                    self.transport.remove_peer(gone.host_agent)

    def host_agent(self, worker_id: str) -> str:
        """The NIXL agent name of decode worker ``worker_id``'s host KV tier, loaded as a peer; a
        LookupError when it has none or it is not loaded (the caller hands the task back)."""
        info = self.peers.get(worker_id)
        if info is None or not info.host_agent or not self.transport.has_peer(info.host_agent):
            raise LookupError(f"decode worker {worker_id!r} has no host KV tier known here")
        return info.host_agent

    def known_peer(self, worker_id: str) -> str | None:
        """The NIXL agent name of `worker_id` when its metadata is loaded, else None (no I/O)."""
        return self._peer_gen.get(worker_id)

    async def ensure_peer(self, worker_id: str) -> str:
        """The NIXL agent name of `worker_id`, loading its metadata now if needed."""
        if worker_id not in self._peer_gen:
            await self.sync_peers()
        agent = self._peer_gen.get(worker_id)
        if agent is None:
            raise LookupError(f"worker {worker_id!r} is not registered")
        return agent

    async def _peer_sync(self) -> None:
        while True:
            try:
                await self.sync_peers()
            except Exception as exc:
                log.warning("peer sync failed", error=str(exc))
            await asyncio.sleep(1.0)

    async def leave(self) -> None:
        """Leaves routing (stops the heartbeat, deletes the registration): first thing on SIGTERM."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        try:
            await asyncio.wait_for(self.store.deregister_worker(self.cfg.worker_id), 2.0)
        except Exception as exc:  # Redis gone: the liveness key expires on its own
            log.warning("deregister failed", error=str(exc))

    async def stop(self) -> None:
        await self.leave()
        await self.transport.aclose()  # its warm-up tasks cancelled and awaited


def _log_redis_retry(state) -> None:
    log.warning("redis unreachable; retrying", attempt=state.attempt_number,
                error=str(state.outcome.exception()) if state.outcome else "")


def add_worker_args(parser, kind: str) -> None:
    """The flags of a ``kind`` ("prefill" or "decode") worker, derived from ampd.config; each also
    reads its AMPD_* environment variable (docker-compose)."""
    add_flags(parser, SERVICE_SETTINGS[kind], env=True)


def worker_config(args, kind: str, port: int) -> WorkerConfig:
    """A ``kind`` worker's config from its parsed flags (``add_worker_args``), bound to ``port``;
    a setting the parser did not take (a prefill worker's ``sidecar``) keeps its default."""
    if not args.worker_id:
        raise ConfigError("--worker-id: required")
    require(args, "redis_url")
    check_names(args)
    values = inherited(args, WorkerConfig)
    if kind == "decode":
        values["prefix_sharing"] = pool_prefix_sharing(values["prefix_sharing"],
                                                       not capabilities_of(args.engine).needs_token_ids)
    values["advertise"] = args.advertise or f"{args.host}:{port}"
    return WorkerConfig(kind=kind, port=port, **values)


def sampling_of(p) -> Sampling:
    """An engine's Sampling from the API's SamplingParams (a Turn's, or a PrefillTask's)."""
    return Sampling(p.temperature, p.top_p or 1.0, p.seed if p.HasField("seed") else None)


def _host_fields(host_peer: tuple[str, bytes, dict] | None) -> dict:
    """WorkerInfo's host_agent/host_metadata/host_layout for ``host_peer`` (nothing when None)."""
    if host_peer is None:
        return {}
    name, md, layout = host_peer
    return {"host_agent": name, "host_metadata": base64.b64encode(md).decode(), "host_layout": layout}
