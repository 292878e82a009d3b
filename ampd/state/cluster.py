"""The coordinator's view of the workers, followed from Redis, and the two decisions taken on it
(binding a new session, routing a prefill). Library, not service: `ampd bench-sched` measures the
same code the coordinator runs."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import structlog

from ampd.config import WorkerSettings
from ampd.policy import CostModel, PrefillTask, RouteDecision, Router, WorkerView, bind, in_worker_order
from ampd.state.liveness import Liveness
from ampd.state.store import REDIS_ERRORS, StateStore, WorkerInfo, WorkerStats, age_view
from ampd.tasks import BackgroundTasks

__all__ = ["Cluster", "ClusterView", "StatsEntry", "RoutedTask", "choose_decode_worker", "route"]

log = structlog.get_logger()

# How long a routed task counts in the view of its worker without the worker naming it (a route that
# did not hold, a task lost with its worker). Workers publish within a few ms of taking a task.
ROUTED_TTL_S = 0.25


class StatsEntry(NamedTuple):
    """A worker's latest statistics, as the view is assembled from them."""
    ts: float  # when the worker published them
    kind: str  # "decode" or "prefill"
    view: WorkerView
    busy_until: float
    accepted: tuple  # the (session, round) tasks the worker counts (WorkerStats.accepted)


class RoutedTask(NamedTuple):
    """A task routed to a worker whose statistics do not show it yet."""
    worker_id: str
    at: float  # when it was routed
    compute_s: float  # its prefill's compute at the worker's TP


@dataclass(frozen=True)
class ClusterView:
    decode: dict[str, WorkerView]
    prefill: tuple[WorkerView, ...]
    read_s: float  # time the Redis read took


class Cluster:
    """The coordinator's view of the workers.

    `read` mode: one HGETALL of every worker's statistics per decision. `push` mode: workers
    PUBLISH every change, a background task keeps the latest of each in memory, and a decision
    reads no Redis at all; the delivery lag of each update (its age when it arrived) is recorded
    so the view's staleness stays measured (`lag_s`).

    Liveness: a view holds only the workers whose liveness key exists (read every ``poll_s`` with the
    registry, so a restarted worker's new address is seen too) and none that ``lost`` was called for
    (a call to it failed on its connection) until it publishes again. While Redis is unreachable the
    last known set stands: an outage of shared state is not an outage of the workers.

    Routed tasks: a worker's statistics show a task only once it reached the worker and the worker
    published (a few ms after the decision), so two rounds routed that close together would each
    see the queue without the other. With ``cost`` given, ``routed`` notes each decision and the
    view adds the task's compute at its target's TP to that worker's ``queue_predicted_s`` until
    the worker's statistics name it (``WorkerStats.accepted``: they count it themselves then) or
    ``ROUTED_TTL_S`` passed. (The simulator's workers take a task the moment it is routed.)
    """

    def __init__(self, store: StateStore, mode: str = "push", poll_s: float = 0.5, grace_s: float = 3.0,
                 cost: CostModel | None = None, fence_after: float = WorkerSettings.fence_after) -> None:
        if mode not in ("push", "read"):
            raise ValueError(f"stats mode must be 'push' or 'read', got {mode!r}")
        self.store = store
        self.mode = mode
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.seen_live: dict[str, float] = {}  # worker_id -> when its liveness key was last seen (monotonic)
        self.live: set[str] | None = None  # workers with a liveness key (None: not read yet, all count)
        self.lost: dict[str, float] = {}  # worker_id -> when a call to it failed on the connection
        self.infos: dict[str, WorkerInfo] = {}
        self._infos_at = 0.0
        self._views: dict[str, StatsEntry] = {}  # worker id -> its latest statistics
        self.cost = cost
        self._routed: dict[tuple[str, int], RoutedTask] = {}  # (session, round) -> where it was routed
        self.lag_s: list[float] = []  # recent delivery lags (push mode), bounded
        self._tasks = BackgroundTasks()  # the stats follower (push mode) and the liveness watch
        self.on_poll = None  # optional coroutine function run after each liveness poll (the coordinator's)
        self.liveness = Liveness(fence_after)
        self.on_fenced = None  # optional function (the WorkerInfo fenced) called after a worker was fenced

    async def refresh_infos(self) -> None:
        """New and re-registered workers (refresh_live is what drops the gone ones)."""
        self.infos.update(await self.store.workers())
        self._infos_at = time.monotonic()

    async def refresh_live(self) -> None:
        """The registry and the liveness keys, re-read. A worker missing from them stays for
        ``grace_s`` (a restarted Redis is empty until the workers register again, within a heartbeat
        or a reconnect back-off). A worker not heard from for ``fence_after`` (stopped, hung or dead)
        is fenced (``fence``): a killed one leaves nothing behind, a stopped one learns it when it
        resumes."""
        now = time.monotonic()
        registered = await self.store.workers()
        beats = await self.store.liveness(registered)
        due = self.liveness.observe({w: i.epoch for w, i in registered.items()}, beats, now)
        infos, live = dict(registered), set(beats)
        for wid in live:
            self.seen_live[wid] = now
        for wid, info in self.infos.items():  # recently live, missing now: keep it a little
            if wid not in live and now - self.seen_live.get(wid, -1e9) < self.grace_s:
                infos.setdefault(wid, info)
                live.add(wid)
        self.infos, self._infos_at, self.live = infos, now, live
        for wid, epoch in due:
            await self.fence(wid, epoch)
        for wid in list(self._views):
            if wid not in self.infos:
                del self._views[wid]

    async def fence(self, worker_id: str, epoch: int) -> None:
        """Fences ``worker_id``'s registration of ``epoch``: it leaves routing and the registry now,
        and ``on_fenced`` moves or fails what it served (docs/deploy.md "Faults")."""
        info = self.infos.pop(worker_id, None)
        silent = time.monotonic() - self.liveness.heard.get(worker_id, time.monotonic())
        self.liveness.forget(worker_id)
        self.seen_live.pop(worker_id, None)
        if self.live is not None:
            self.live.discard(worker_id)
        self.lost[worker_id] = time.time()
        fenced = await self.store.fence(worker_id, epoch)
        log.warning("worker fenced: not heard from", worker=worker_id, epoch=epoch, silent_s=round(silent, 1),
                    fenced=fenced)
        if fenced and info is not None and self.on_fenced is not None:
            self.on_fenced(info)

    def mark_lost(self, worker_id: str) -> None:
        """A call to ``worker_id`` failed on its connection: it leaves routing now (not when its
        liveness key expires), until it publishes statistics again."""
        if worker_id not in self.lost:
            log.warning("worker lost", worker=worker_id)
        self.lost[worker_id] = time.time()

    async def start(self) -> None:
        await self.refresh_live()
        if self.mode == "push":
            ps = self.store.subscribe()
            await ps.subscribe(self.store.k_stats)  # subscribe first, then snapshot: no gap
            for st in (await self.store.stats()).values():
                await self._ingest(st)
            self._tasks.spawn(self._follow(ps), name="stats-follower")
        self._tasks.spawn(self._watch(), name="liveness-watch")

    async def stop(self) -> None:
        await self._tasks.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh_live()
                if self.on_poll is not None:
                    await self.on_poll()
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as exc:
                log.warning("liveness read failed; keeping the last known workers", error=str(exc))
            except Exception as exc:  # noqa: BLE001 - the watch must outlive any one bad read
                log.warning("liveness poll failed", error=repr(exc))

    async def _follow(self, ps) -> None:
        while True:
            try:
                # blocking, without a timeout: a timeout costs a timer and its context a message
                msg = await ps.get_message(timeout=None)
                if msg is None or msg.get("type") != "message":
                    continue
                st = WorkerStats.from_json(msg["data"])
                lag = time.time() - st.ts
                if len(self.lag_s) >= 10_000:
                    del self.lag_s[:5_000]
                self.lag_s.append(lag)
                await self._ingest(st)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a Redis blip: resubscribe and take a fresh snapshot
                log.warning("stats channel failed; resubscribing", error=str(exc))
                await asyncio.sleep(0.2)
                try:
                    ps = self.store.subscribe()
                    await ps.subscribe(self.store.k_stats)
                    for st in (await self.store.stats()).values():
                        await self._ingest(st)
                except Exception:
                    pass

    async def _ingest(self, st: WorkerStats) -> None:
        info = self.infos.get(st.worker_id)
        if info is None:
            await self.refresh_infos()
            info = self.infos.get(st.worker_id)
            if info is None:
                return
        prev = self._views.get(st.worker_id)
        if prev is None or st.ts >= prev.ts:
            self._views[st.worker_id] = StatsEntry(st.ts, info.kind, st.view(info.kind, info.tp), st.busy_until,
                                               st.accepted)
        self._alive_again(st.worker_id, st.ts)

    def _alive_again(self, worker_id: str, ts: float) -> None:
        lost_at = self.lost.get(worker_id)
        if lost_at is not None and ts > lost_at:  # it published after a call to it failed: it is back
            del self.lost[worker_id]

    async def view(self) -> ClusterView:
        if self.mode == "push":
            return self._assemble(self._views.values(), 0.0)
        t0 = time.perf_counter()
        stats = await self.store.stats()
        read_s = time.perf_counter() - t0
        if any(wid not in self.infos for wid in stats) or time.monotonic() - self._infos_at > 5.0:
            await self.refresh_infos()
        entries = []
        for wid, st in stats.items():
            info = self.infos.get(wid)
            if info is not None:
                entries.append(StatsEntry(st.ts, info.kind, st.view(info.kind, info.tp), st.busy_until, st.accepted))
                self._alive_again(wid, st.ts)
        return self._assemble(entries, read_s)

    def routed(self, view: ClusterView, req: PrefillTask, decision: RouteDecision, now: float) -> None:
        """Notes a decision taken on ``view`` (see the class docstring)."""
        if self.cost is None:
            return
        if decision.local:
            target = view.decode.get(req.decode_worker)
        else:
            target = next((p for p in view.prefill if p.worker_id == decision.target), None)
        if target is not None:
            self._routed[(req.session_id, req.round)] = RoutedTask(
                target.worker_id, now, self.cost.t_pre(target.tp, req.l_hist, req.l_incr))

    def _not_yet_taken(self, entries: list[StatsEntry], now: float) -> dict[str, float]:
        """worker id -> the compute of the tasks routed there that its statistics do not show yet."""
        accepted = {e.view.worker_id: e.accepted for e in entries}
        out: dict[str, float] = {}
        for key, (wid, at, s) in list(self._routed.items()):
            if now - at > ROUTED_TTL_S or key in accepted.get(wid, ()):
                del self._routed[key]
            else:
                out[wid] = out.get(wid, 0.0) + s
        return out

    def _assemble(self, entries: Iterable[StatsEntry], read_s: float) -> ClusterView:
        now = time.time()
        decode: dict[str, WorkerView] = {}
        prefill: list[WorkerView] = []
        if self._routed:
            entries = list(entries)
            pending = self._not_yet_taken(entries, now)
        else:
            pending = None
        for ts, kind, v, busy_until, _ in entries:
            if (self.live is not None and v.worker_id not in self.live) or v.worker_id in self.lost:
                continue  # its liveness key expired, or a call to it failed on the connection
            v = age_view(v, ts, busy_until, now)  # the prefill in service progressed since ts
            if pending and v.worker_id in pending:
                v = replace(v, queue_predicted_s=v.queue_predicted_s + pending[v.worker_id])
            if kind == "decode":
                decode[v.worker_id] = v
            else:
                prefill.append(v)
        # Algorithm 1 visits prefill workers in a seeded order over list positions: the simulator's order.
        return ClusterView(decode, tuple(in_worker_order(prefill)), read_s)


def choose_decode_worker(view: ClusterView) -> str:
    return bind(list(view.decode.values()))


def route(router: Router, view: ClusterView, req: PrefillTask, now: float) -> RouteDecision:
    decode = view.decode.get(req.decode_worker)
    if decode is None:
        raise LookupError(f"decode worker {req.decode_worker!r} is gone")
    return router.route(req, decode, view.prefill, now)
