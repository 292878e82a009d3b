"""Coordinator core: validation, binding and routing over a snapshot of the cluster in Redis."""
from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from ampd.policy import PrefillRequest, RouteDecision, Router, WorkerView, bind
from ampd.state import StateStore, WorkerInfo
from ampd.v1 import common_pb2
from ampd.worker import STALE_AFTER_S

log = structlog.get_logger()

MAX_SESSION_ID = 256


class InvalidArgument(ValueError):
    """A bad request field; the message starts with the field's path."""


def validate_open(o: common_pb2.OpenSession) -> None:
    """Checks an OpenSession; raises InvalidArgument naming the first bad field."""
    if not o.session_id:
        raise InvalidArgument("open.session_id: required")
    if len(o.session_id) > MAX_SESSION_ID:
        raise InvalidArgument(f"open.session_id: longer than {MAX_SESSION_ID} characters")
    if not o.rounds:
        raise InvalidArgument("open.rounds: at least one round is required")
    for i, r in enumerate(o.rounds):
        path = f"open.rounds[{i}]"
        if not r.HasField("input_tokens"):
            raise InvalidArgument(f"{path}.input_tokens: required")
        if r.input_tokens < 1:
            raise InvalidArgument(f"{path}.input_tokens: must be >= 1, got {r.input_tokens}")
        if not r.HasField("output_tokens"):
            raise InvalidArgument(f"{path}.output_tokens: required")
        if r.output_tokens < 1:
            raise InvalidArgument(f"{path}.output_tokens: must be >= 1, got {r.output_tokens}")
        if r.HasField("tool") and r.tool.latency_s < 0:
            raise InvalidArgument(f"{path}.tool.latency_s: must be >= 0, got {r.tool.latency_s}")
    if o.limits.max_rounds < 0:
        raise InvalidArgument(f"open.limits.max_rounds: must be >= 0, got {o.limits.max_rounds}")
    if o.limits.max_output_tokens < 0:
        raise InvalidArgument(
            f"open.limits.max_output_tokens: must be >= 0, got {o.limits.max_output_tokens}")


@dataclass(frozen=True)
class ClusterView:
    decode: dict[str, WorkerView]
    prefill: tuple[WorkerView, ...]
    read_s: float  # time the Redis read took


class Cluster:
    """Worker registry cache plus the per-decision statistics read (one HGETALL)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.infos: dict[str, WorkerInfo] = {}
        self._infos_at = 0.0

    async def refresh_infos(self) -> None:
        self.infos = await self.store.workers()
        self._infos_at = time.monotonic()

    async def view(self) -> ClusterView:
        t0 = time.perf_counter()
        stats = await self.store.stats()
        read_s = time.perf_counter() - t0
        if any(wid not in self.infos for wid in stats) or time.monotonic() - self._infos_at > 5.0:
            await self.refresh_infos()
        now = time.time()
        decode: dict[str, WorkerView] = {}
        prefill: list[WorkerView] = []
        for wid, st in stats.items():
            info = self.infos.get(wid)
            if info is None or now - st.ts > STALE_AFTER_S:
                continue
            v = st.view(info.kind, info.tp)
            if info.kind == "decode":
                decode[wid] = v
            else:
                prefill.append(v)
        prefill.sort(key=lambda v: v.worker_id)
        return ClusterView(decode, tuple(prefill), read_s)


def choose_decode_worker(view: ClusterView) -> str:
    return bind(list(view.decode.values()))


def route(router: Router, view: ClusterView, req: PrefillRequest, now: float) -> RouteDecision:
    decode = view.decode.get(req.decode_worker)
    if decode is None:
        raise LookupError(f"decode worker {req.decode_worker!r} is gone")
    return router.route(req, decode, view.prefill, now)
