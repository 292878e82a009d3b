"""What to simulate: the deployment, the policy and its options, and the live path's latencies."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ampd.config import inherit

__all__ = ["PathLatency", "SimConfig"]


@dataclass(frozen=True)
class PathLatency:
    """What the live control path adds to a round, in seconds (all 0 by default: the paper's model).

    ``open_s``: a new session from the coordinator accepting it to its first round being routed
    (bind, attach); ``dispatch_s``: a round's input ready at the decode worker to the coordinator
    routing it and the task reaching the chosen queue; ``handoff_s``: a remote prefill's end to the
    decode worker holding its first token (KV-written notification); ``tool_s``: added to every tool
    call (the sidecar RPC); ``prefill_busy_s``: how much longer than modelled (read + compute +
    write-back) each remote prefill holds its prefill worker (timer slack, the KV write and its
    completion poll); unlike the others it adds up along a queue. The workers' predicted queues
    (``busy_until``) do not include it, as live. ``step_s``: how much longer than modelled each
    decode step of a decode worker takes (the step's Python work, one event per token, the
    timer); it adds up along a round's tokens, and the routers' estimates do not include it, as
    live. TTFT still runs from the input being ready."""

    open_s: float = 0.0
    dispatch_s: float = 0.0
    handoff_s: float = 0.0
    tool_s: float = 0.0
    prefill_busy_s: float = 0.0
    step_s: float = 0.0

    FIELDS = ("open", "dispatch", "handoff", "tool", "prefill_busy", "step")

    def __post_init__(self):
        for f in self.FIELDS:
            v = getattr(self, f + "_s")
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"path latency {f!r} must be a number >= 0 seconds, got {v!r}")

    @property
    def zero(self) -> bool:
        return not (self.open_s or self.dispatch_s or self.handoff_s or self.tool_s or self.prefill_busy_s
                    or self.step_s)

    @classmethod
    def parse(cls, text: str) -> "PathLatency":
        """``"dispatch=0.012,handoff=0.002"`` (seconds; unnamed fields stay 0; '' or 'none': all 0)."""
        text = (text or "").strip()
        if text in ("", "none", "0"):
            return cls()
        vals: dict[str, float] = {}
        for part in text.split(","):
            name, sep, num = part.strip().partition("=")
            name = name.strip()
            if not sep or name not in cls.FIELDS:
                raise ValueError(f"path latency {part.strip()!r}: expected NAME=SECONDS with NAME one of "
                                 f"{', '.join(cls.FIELDS)}")
            if name in vals:
                raise ValueError(f"path latency {name!r} given twice")
            try:
                vals[name] = float(num)
            except ValueError:
                raise ValueError(f"path latency {name!r}: {num.strip()!r} is not a number") from None
        return cls(**{k + "_s": v for k, v in vals.items()})

    def format(self) -> str:
        parts = [f"{f}={getattr(self, f + '_s'):g}" for f in self.FIELDS if getattr(self, f + "_s")]
        return ",".join(parts) or "none"


@dataclass
class SimConfig:
    """What to simulate. ``prefill``/``decode`` are SPEC strings or (tp, replicas) groups.

    ``reorder_window``: Algorithm 2's lookahead ``w`` (``ampd up --reorder-window``).
    ``chunked_prefill``: local prefills in chunks interleaved with decode steps (beyond the paper).
    ``kv_contention``: KV transfers share each worker's NIC (one at a time per NIC).
    ``kv_admission``: what a round whose new KV does not fit does, ``"wait"`` or ``"fail"``
    (``ampd.worker.DecodeCore``). ``kv_evict``: a round whose KV does not fit first evicts the KV of
    sessions idle in tool calls, least recently used first. ``kv_host_ratio``: each decode worker's host KV
    tier as a multiple of its device KV pool (0: off), ``kv_host_mb`` its size in MiB instead (0: by the
    ratio; ``ampd.worker.decode_tier``, ``ampd.policy.hostpool.size_host_pool``), ``kv_offload_pressure``
    its policy's pressure threshold, ``kv_prefetch_early`` its prefetch at the tool's expected end.
    ``prefix_sharing``: rounds with ``hash_ids`` share the prompt blocks their decode worker holds
    (``ampd.sim.prefixing``), also with ``kv_evict``, the host tier and a KV-pinning policy (shared
    blocks stay, own KV moves).
    ``kv_overlap``: a prefill worker reads the next task's history KV
    while the current one computes (the paper's section 6; ``ampd.worker.PrefillCore``).
    ``router_options``: keywords for ``ampd.policy.make_router`` (alpha, beta, slack, ...).
    ``admission``, ``admission_wait``, ``admission_queue``: the coordinator's admission of new
    sessions (``ampd.policy.admit.AdmissionBook``, the same core): a session is bound where its
    whole KV (every round's input and output, plus ``block_tokens`` for a partly filled last block)
    is promised, or waits, or is refused.

    Each field that holds an ampd.config setting names it (``inherit``) and takes its default from
    there; the ``_s`` fields are in seconds (``window_s``: ``--stats-window``)."""

    profile: Any  # a loaded ampd.perf.Profile
    policy: str
    prefill: Any = ()  # resolved (ampd.deployment.worker_shape): no 'auto' here
    decode: Any = inherit("decode")
    ttft_slo_s: float = inherit("ttft_slo")
    itl_slo_s: float = inherit("itl_slo")
    seed: int = inherit("seed")
    window_s: float = inherit("stats_window")
    kv_contention: bool = inherit("kv_contention")
    reorder_window: int = inherit("reorder_window")
    chunked_prefill: bool = inherit("chunked_prefill")
    kv_admission: str = inherit("kv_admission")
    kv_evict: bool = inherit("kv_evict")
    kv_overlap: bool = inherit("kv_overlap")
    kv_host_ratio: float = inherit("kv_host_ratio")
    kv_host_mb: float = inherit("kv_host_mb")
    kv_offload_pressure: float = inherit("kv_offload_pressure")
    kv_prefetch_early: bool = inherit("kv_prefetch_early")
    prefix_sharing: bool = inherit("prefix_sharing")
    admission: str = inherit("admission")
    admission_wait: float = inherit("admission_wait")
    admission_queue: int = inherit("admission_queue")
    block_tokens: int = inherit("block_tokens")
    router_options: dict = field(default_factory=dict)
    path: PathLatency = field(default_factory=PathLatency)  # live control-path latencies (default none)
