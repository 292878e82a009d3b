"""The coordinator's view of the workers, followed from Redis, and the two decisions taken on it
(binding a new session, routing a prefill). Library, not service: `ampd bench-sched` measures the
same code the coordinator runs."""
from __future__ import annotations

import asyncio
import contextlib
import math
import re
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
# How long stop waits for a liveness poll in flight to end (a Redis that does not answer: no longer).
STOP_WAIT_S = 2.0


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
        # worker id -> its latest publication (push mode) not parsed yet, and its ts: parsed when a
        # view is read (a worker often publishes again before the next decision)
        self._unparsed: dict[str, tuple[float, bytes]] = {}
        self.cost = cost
        # (session, round) -> where it was routed, oldest first; and per worker the count and the
        # sum of their compute, kept as tasks come and go (a view reads them: no scan per decision)
        self._routed: dict[tuple[str, int], RoutedTask] = {}
        self._routed_s: dict[str, float] = {}
        self._routed_n: dict[str, int] = {}
        self.lag_s: list[float] = []  # recent delivery lags (push mode), bounded
        self._tasks = BackgroundTasks()  # the stats follower (push mode) and the liveness watch
        self._watcher: asyncio.Task | None = None
        self._polling = False  # the liveness watch is inside a poll (not asleep between two)
        self._stopping = False
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
        for wid in list(self._unparsed):
            if wid not in self.infos:
                del self._unparsed[wid]

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
        self._watcher = self._tasks.spawn(self._watch(), name="liveness-watch")

    async def stop(self) -> None:
        self._stopping = True
        if self._polling and self._watcher is not None:
            # A poll cut off mid-command may still land: its owner's liveness write (on_poll) would
            # then reach Redis after the owner deleted that key at stop. It ends first (bounded).
            await asyncio.wait({self._watcher}, timeout=STOP_WAIT_S)
        await self._tasks.close()

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.poll_s)
            self._polling = True
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
            finally:
                self._polling = False

    async def _follow(self, ps) -> None:
        while True:
            try:
                # Read off the subscribed connection as it comes (["message", channel, data], and
                # subscribe confirmations), blocking without a timeout (math.inf: redis-py's "no
                # timeout" for a pub/sub read; a timer and its context a message cost more). Not
                # get_message: its retry wrapper and dict per message cost more than the rest of this
                # loop. A failed read resubscribes below, with a fresh snapshot.
                msg = await ps.connection.read_response(timeout=math.inf, disconnect_on_error=False,
                                                        push_request=True)
                if not msg or msg[0] not in _MESSAGE:
                    continue
                self._arrived(msg[2])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a Redis blip: resubscribe and take a fresh snapshot
                log.warning("stats channel failed; resubscribing", error=str(exc))
                await asyncio.sleep(0.2)
                with contextlib.suppress(Exception):  # (its connection back to the pool, or dropped)
                    await ps.aclose()
                try:
                    ps = self.store.subscribe()
                    await ps.subscribe(self.store.k_stats)
                    for st in (await self.store.stats()).values():
                        await self._ingest(st)
                except Exception:
                    pass

    def _arrived(self, raw: bytes) -> None:
        """A publication: its delivery lag recorded, and kept to be parsed when a view is read
        (only the latest of each worker is: most are replaced before the next decision)."""
        if isinstance(raw, str):  # (a client decoding its responses)
            raw = raw.encode()
        head = _HEAD.match(raw)
        if head is None:  # not as WorkerStats.to_json writes it (its first fields): parsed now
            st = WorkerStats.from_json(raw)
            self._lag(st.ts)
            if st.worker_id in self.infos:
                pending = self._unparsed.get(st.worker_id)
                if pending is not None and pending[0] <= st.ts:  # (a newer one queued stays queued)
                    del self._unparsed[st.worker_id]
                self._ingest_now(st)
            else:  # a worker not known yet: the view's read looks it up in the registry first
                self._unparsed[st.worker_id] = (st.ts, raw)
            return
        wid, ts = head[1].decode(), float(head[2])
        self._lag(ts)
        if wid in self.infos:  # (an unknown worker's, once the registry is read again)
            self._alive_again(wid, ts)
        prev = self._views.get(wid)
        if prev is not None and ts < prev.ts:
            return
        pending = self._unparsed.get(wid)
        if pending is None or ts >= pending[0]:
            self._unparsed[wid] = (ts, raw)

    def _lag(self, ts: float) -> None:
        if len(self.lag_s) >= 10_000:
            del self.lag_s[:5_000]
        self.lag_s.append(time.time() - ts)

    async def _parse_unparsed(self) -> None:
        # Every known worker's publication is taken in before anything awaits: a registry read for
        # an unknown worker yields, and a view read meanwhile finds ``_unparsed`` empty, so it must
        # already see the other workers' latest statistics.
        pending, self._unparsed = self._unparsed, {}
        unknown = []
        for wid, (_, raw) in pending.items():
            try:
                st = WorkerStats.from_json(raw)
            except Exception as exc:  # noqa: BLE001 - one bad publication must not fail a decision
                log.warning("unreadable worker statistics; skipped", worker=wid, error=repr(exc))
                continue
            if st.worker_id in self.infos:
                self._ingest_now(st)
            else:
                unknown.append(st)
        if unknown:
            await self.refresh_infos()
            for st in unknown:
                self._ingest_now(st)

    async def _ingest(self, st: WorkerStats) -> None:
        if st.worker_id not in self.infos:
            await self.refresh_infos()
        self._ingest_now(st)

    def _ingest_now(self, st: WorkerStats) -> None:
        info = self.infos.get(st.worker_id)
        if info is None:  # (not registered, even after a fresh read of the registry)
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
            if self._unparsed:
                await self._parse_unparsed()
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
            key = (req.session_id, req.round)
            if key in self._routed:  # routed again: it counts once, from now
                self._drop(key)
            task = self._routed[key] = RoutedTask(target.worker_id, now, self.cost.t_pre(target.tp, req.l_hist,
                                                                                          req.l_incr))
            self._routed_s[task.worker_id] = self._routed_s.get(task.worker_id, 0.0) + task.compute_s
            self._routed_n[task.worker_id] = self._routed_n.get(task.worker_id, 0) + 1

    def _drop(self, key: tuple[str, int]) -> None:
        wid, _, s = self._routed.pop(key)
        n = self._routed_n[wid] - 1
        if n:
            self._routed_n[wid] = n
            self._routed_s[wid] -= s
        else:  # (exactly nothing, not what subtractions leave)
            del self._routed_n[wid], self._routed_s[wid]

    def _not_yet_taken(self, entries: list[StatsEntry], now: float) -> dict[str, float]:
        """worker id -> the compute of the tasks routed there that its statistics do not show yet.
        Bounded work per view, whatever the rate: each worker names at most its last few tasks
        (ACCEPTED_KEPT), and the tasks are routed in time order, so the expired ones are the first."""
        routed = self._routed
        for e in entries:
            for key in e.accepted:
                task = routed.get(key)
                if task is not None and task.worker_id == e.view.worker_id:
                    self._drop(key)
        expired = []
        for key, task in routed.items():
            if now - task.at <= ROUTED_TTL_S:
                break
            expired.append(key)
        for key in expired:
            self._drop(key)
        return self._routed_s

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


# A publication's first fields as WorkerStats.to_json writes them (its dataclass fields in order):
# its worker and time, read without parsing the rest (ampd.state.store)
_HEAD = re.compile(rb'\{"worker_id":"([^"\\]+)","ts":([0-9.eE+-]+)[,}]')
_MESSAGE = (b"message", "message")  # a pub/sub reply's kind (bytes; str when responses are decoded)
