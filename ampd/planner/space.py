"""The planner's search space: deployments, the TP degrees a replica may use, input errors."""
from __future__ import annotations

from dataclasses import dataclass

from ampd.deployment import format_spec

__all__ = ["DEGREES", "KINDS", "Deployment", "PlanError", "feasible_degrees"]

# The model-parallel degrees the paper plans over (powers of two, one node at most).
DEGREES = (1, 2, 4, 8)

# Replica kinds: a prefill worker, a decode worker beside prefill workers, and a co-located worker
# (a decode worker that runs every prefill itself; the deployment has no prefill workers).
KINDS = ("prefill", "decode", "colocated")


class PlanError(ValueError):
    """Bad planning input. ``field`` names the request field (CLI flag or proto field) at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, order=True)
class Deployment:
    """Replica counts per TP degree: ``prefill[n]``/``decode[n]`` as sorted ``(n, count)`` pairs
    with count >= 1. A co-located deployment has no prefill replicas (``colocated`` is True); its
    decode replicas also run every prefill."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]

    @staticmethod
    def of(prefill: dict[int, int], decode: dict[int, int]) -> "Deployment":
        def norm(d):
            return tuple(sorted(((int(n), int(c)) for n, c in d.items() if c > 0), reverse=True))
        return Deployment(norm(prefill), norm(decode))

    @property
    def colocated(self) -> bool:
        return not self.prefill

    @property
    def gpus(self) -> int:
        return sum(n * c for n, c in self.prefill) + sum(n * c for n, c in self.decode)

    @property
    def prefill_spec(self) -> str:
        return format_spec(self.prefill)

    @property
    def decode_spec(self) -> str:
        return format_spec(self.decode)

    def groups(self, kind: str) -> tuple[tuple[int, int], ...]:
        """The replica groups that carry ``kind``'s latency term."""
        if kind == "prefill":
            return self.prefill
        if kind == "decode":
            return () if self.colocated else self.decode
        return self.decode if self.colocated else ()

    def __str__(self) -> str:
        return f"prefill {self.prefill_spec} decode {self.decode_spec}"


def feasible_degrees(profile, gpus: int, max_context_tokens: int,
                     degrees: tuple[int, ...] = DEGREES) -> tuple[int, ...]:
    """The degrees ``n`` whose replica holds the model: the profile covers ``n`` (a shipped profile
    lists only the degrees whose weights fit, see ampd/perf/derive.py), its KV capacity holds the
    longest session of the workload, and ``n <= gpus``. Raises :class:`PlanError` when none does."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError("gpus", f"must be an integer >= 1, got {gpus!r}")
    fits = [n for n in degrees if n in profile.tps and profile.kv_capacity_tokens(n) >= max_context_tokens]
    if not fits:
        raise PlanError("profile", f"no TP degree of {profile.name} (covers {list(profile.tps)}) holds the "
                                   f"model and a {max_context_tokens}-token session in one replica")
    usable = tuple(n for n in fits if n <= gpus)
    if not usable:
        raise PlanError("gpus", f"{gpus} GPUs cannot hold one replica of {profile.name}: the smallest replica "
                                f"that holds the model needs {min(fits)} GPUs")
    return usable
