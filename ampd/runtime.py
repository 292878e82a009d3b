"""Plumbing every worker (prefill and decode) shares: KV pool + NIXL, Redis registration,
statistics publishing, peer discovery. The decisions stay in ampd.policy; this only adapts."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import structlog

from ampd.kv import KVPool, PoolLayout
from ampd.perf import Profile
from ampd.policy import PrefillQueue
from ampd.state import StateStore, WorkerInfo, WorkerStats
from ampd.window import WindowedMean

log = structlog.get_logger()

STALE_AFTER_S = 10.0  # a worker whose stats are older than this is treated as gone (a loaded 2-core box
# can delay a worker's 0.5 s heartbeat by seconds; a false "gone" fails sessions, a late one only delays)
HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    kind: str
    host: str
    port: int
    advertise: str  # address other services dial
    redis_url: str
    namespace: str
    profile: str
    tp: int
    engine: str
    policy: str
    ttft_slo_s: float
    itl_slo_s: float
    window_s: float = 10.0
    reorder_window: int = 3
    block_tokens: int = 32
    kv_bytes_per_token: int = 64  # bytes the mock keeps per token (the profile's are for timing)
    kv_pool_mb: int = 256


def pool_for(profile: Profile, cfg: WorkerConfig) -> KVPool:
    """A pool sized like the profile's KV capacity, capped by the memory this process may use."""
    tokens = min(
        profile.kv_capacity_tokens(cfg.tp),
        cfg.kv_pool_mb * 2**20 // cfg.kv_bytes_per_token,
    )
    return KVPool(max(1, tokens // cfg.block_tokens), cfg.block_tokens, cfg.kv_bytes_per_token)


class WorkerRuntime:
    """Owns the pool, the NIXL agent, the Redis registration and the stats publisher."""

    def __init__(self, cfg: WorkerConfig, store: StateStore, pool: KVPool, queue: PrefillQueue) -> None:
        from ampd.kv import NixlTransport

        self.cfg = cfg
        self.store = store
        self.pool = pool
        self.queue = queue
        self.agent_name = f"{cfg.worker_id}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self.transport = NixlTransport(self.agent_name, pool)
        self.window = WindowedMean(cfg.window_s)
        self.active_sessions = 0
        # Predicted end (unix time) of the prefill in service: its remaining time counts as queued
        # work in queue_predicted_s, so a worker that just started a long prefill is not "empty".
        self.busy_until = 0.0
        self.extra: dict = {}
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._peer_gen: dict[str, str] = {}  # worker_id -> nixl agent name loaded

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
        )

    def snapshot(self) -> WorkerStats:
        now = time.time()
        return WorkerStats(
            worker_id=self.cfg.worker_id,
            ts=now,
            window_mean_s=self.window.mean(now),
            queue=tuple(
                (t.session_id, t.round, t.l_hist, t.l_incr, t.enqueued_at) for t in self.queue.tasks()
            ),
            queue_predicted_s=self.queue.predicted_total() + max(0.0, self.busy_until - now),
            kv_free_tokens=self.pool.free_tokens,
            active_sessions=self.active_sessions,
            extra=self.extra,
            busy_until=self.busy_until if self.busy_until > now else 0.0,
        )

    async def start(self, sidecar: str = "") -> None:
        await self.store.register_worker(self.info(sidecar), self.transport.metadata(), self.snapshot())
        self._tasks.append(asyncio.create_task(self._publisher(), name="stats-publisher"))
        self._tasks.append(asyncio.create_task(self._peer_sync(), name="peer-sync"))

    def changed(self) -> None:
        """Marks the queue/KV/window as changed: the publisher pushes it to Redis promptly."""
        self._dirty.set()

    async def _publisher(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                pass
            # Let the tasks woken with this change (the prefill or token it belongs to) run first:
            # the publish is a Redis round trip the request path need not wait behind.
            await asyncio.sleep(0)
            self._dirty.clear()
            try:
                await self.store.publish_stats(self.snapshot())
            except Exception as exc:  # Redis blips must not kill the worker
                log.warning("stats publish failed", error=str(exc))
                await asyncio.sleep(0.2)

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
                self.transport.add_peer(info.nixl_agent, md, PoolLayout.from_dict(info.layout))
                self._peer_gen[wid] = info.nixl_agent
                log.info("nixl peer added", peer=wid, agent=info.nixl_agent)
            except Exception as exc:
                log.warning("nixl peer add failed", peer=wid, error=str(exc))
        for wid in list(self._peer_gen):
            if wid not in workers:
                self.transport.remove_peer(self._peer_gen.pop(wid))

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

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.store.deregister_worker(self.cfg.worker_id)
        except Exception:
            pass
        self.transport.close()


def add_worker_args(parser) -> None:
    """Command-line flags every worker takes (the launcher and docker-compose pass the same)."""
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--advertise", default="", help="address others dial (default host:port)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--namespace", default="ampd")
    parser.add_argument("--profile", default="qwen3-32b@h20")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--engine", default="mock", choices=["mock"])
    parser.add_argument("--policy", default="ampd")
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--itl-slo", type=float, default=0.1)
    parser.add_argument("--window", type=float, default=10.0, help="statistics window, seconds")
    parser.add_argument("--reorder-window", type=int, default=3)
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--kv-bytes-per-token", type=int, default=64)
    parser.add_argument("--kv-pool-mb", type=int, default=256)
    parser.add_argument("--ready-file", default="", help="write the bound port here once serving")


def config_from_args(args, kind: str, port: int) -> WorkerConfig:
    return WorkerConfig(
        worker_id=args.worker_id,
        kind=kind,
        host=args.host,
        port=port,
        advertise=args.advertise or f"{args.host}:{port}",
        redis_url=args.redis_url,
        namespace=args.namespace,
        profile=args.profile,
        tp=args.tp,
        engine=args.engine,
        policy=args.policy,
        ttft_slo_s=args.ttft_slo,
        itl_slo_s=args.itl_slo,
        window_s=args.window,
        reorder_window=args.reorder_window,
        block_tokens=args.block_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_pool_mb=args.kv_pool_mb,
    )


def write_ready_file(path: str, port: int) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)
