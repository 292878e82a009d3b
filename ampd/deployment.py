"""Deployment shapes: SPEC strings and the co-located rule, shared by `ampd up` and `ampd simulate`.

A SPEC lists replica groups ``tpN*R``, comma-separated (README.md, "The command line"): ``tp4*2`` is two
replicas of TP 4; ``tp4*1,tp2*2`` mixes degrees; ``tp8`` is short for ``tp8*1``. An empty string,
``none``, ``-`` or ``0`` is the empty deployment (no workers of that kind). A bare count ``N`` is
``tp1*N``. Pure.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO", "AUTO_PREFILL", "SpecError", "parse_spec", "format_spec", "expand_spec", "Shape", "worker_shape", "check_names"]

# --prefill's default (ampd.config): no prefill worker under a co-located policy, AUTO_PREFILL under a
# disaggregated one for `ampd up` (a deployment that starts with no flags at all)
AUTO = "auto"
AUTO_PREFILL = "tp1*1"

_GROUP = re.compile(r"^tp(\d+)(?:\*(\d+))?$")
_EMPTY = {"", "none", "-", "0"}


class SpecError(ValueError):
    """A malformed deployment SPEC; the message is one line naming the bad part."""


def parse_spec(spec: str | None) -> tuple[tuple[int, int], ...]:
    """``"tp4*1,tp2*2"`` -> ``((4, 1), (2, 2))``: (tp, replicas) per group, in the order given."""
    if spec is None:
        return ()
    text = spec.strip().lower()
    if text in _EMPTY:
        return ()
    if text.isdigit():  # a bare count: that many workers of TP 1
        return ((1, int(text)),)
    groups: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        m = _GROUP.match(part)
        if not m:
            raise SpecError(f"bad replica group {part!r} in SPEC {spec!r}: expected tpN*R, e.g. tp4*2")
        tp = int(m.group(1))
        reps = int(m.group(2)) if m.group(2) is not None else 1
        if tp < 1:
            raise SpecError(f"bad replica group {part!r} in SPEC {spec!r}: TP degree must be >= 1")
        if reps < 1:
            raise SpecError(f"bad replica group {part!r} in SPEC {spec!r}: replica count must be >= 1")
        groups.append((tp, reps))
    return tuple(groups)


def expand_spec(groups) -> list[int]:
    """((4, 1), (2, 2)) -> [4, 2, 2]: one TP degree per worker."""
    return [tp for tp, reps in groups for _ in range(reps)]


def format_spec(groups) -> str:
    """Inverse of parse_spec (``"none"`` for the empty deployment)."""
    return ",".join(f"tp{tp}*{reps}" for tp, reps in groups) or "none"


@dataclass(frozen=True)
class Shape:
    """The workers a deployment runs: (tp, replicas) groups of each kind."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    colocated: bool  # the decode workers also take what were prefill GPUs (a co-located policy)


def _merge(a, b) -> tuple[tuple[int, int], ...]:
    counts: dict[int, int] = {}
    for tp, reps in (*a, *b):
        counts[tp] = counts.get(tp, 0) + reps
    return tuple(counts.items())


def worker_shape(policy: str, prefill: str | None, decode: str | None, tps=None,
                 auto_prefill: str | None = AUTO_PREFILL) -> Shape:
    """The one rule for `ampd up`, `ampd simulate` and the benchmarks: a co-located policy (one that
    runs no prefill workers) turns the prefill GPUs into co-located workers, so the GPU count stays
    what was asked. ``prefill`` ``auto`` (or None: not given) is no prefill worker under a co-located
    policy and ``auto_prefill`` under a disaggregated one (None: it must be given). A policy that
    sends prefills to prefill workers and has none is an error. ``tps``: the TP degrees the profile
    covers (checked when given). Raises SpecError naming the flag (``--prefill``/``--decode``) or
    ValueError for an unknown policy."""
    from ampd.policy import policy_spec

    spec = policy_spec(policy)
    if prefill is None or prefill.strip().lower() == AUTO:
        if not spec.uses_prefill_workers:
            prefill = "none"
        elif auto_prefill is None:
            raise SpecError(f"--prefill: policy {policy} runs prefill workers: give --prefill SPEC (e.g. "
                            f"tp4*1), or a co-located policy ({', '.join(_colocated())})")
        else:
            prefill = auto_prefill
    groups = {}
    for flag, text in (("--prefill", prefill), ("--decode", decode)):
        try:
            groups[flag] = parse_spec(text)
        except SpecError as exc:
            raise SpecError(f"{flag}: {exc}") from None
        if tps is not None:
            for tp, _ in groups[flag]:
                if tp not in tps:
                    raise SpecError(f"{flag}: TP {tp} is not in the profile (it covers "
                                    f"{', '.join(map(str, tps))})")
    pre, dec = groups["--prefill"], groups["--decode"]
    if spec.needs_prefill_workers and not pre:
        raise SpecError(f"--prefill: policy {policy} sends prefills to prefill workers, and --prefill {prefill} "
                        f"has none: give --prefill SPEC (e.g. tp4*1), or a co-located policy "
                        f"({', '.join(_colocated())})")
    if not spec.uses_prefill_workers:
        pre, dec = (), _merge(dec, pre)
    if not dec:
        raise SpecError("--decode: the deployment needs at least one decode worker")
    return Shape(pre, dec, not spec.uses_prefill_workers)


def _colocated() -> list[str]:
    from ampd.policy import POLICIES, policy_spec

    return [p for p in POLICIES if not policy_spec(p).uses_prefill_workers]


def check_names(args: Any) -> None:
    """Checks the settings whose valid values live in a registry (policy, profile), as a service
    does before it binds a port: ConfigError names the flag and lists what is valid."""
    from ampd.config import ConfigError, env_name, flag_name
    from ampd.perf import load_profile
    from ampd.policy import policy_spec

    get = args.get if isinstance(args, Mapping) else (lambda k, d=None: getattr(args, k, d))

    for name, lookup in (("policy", policy_spec), ("profile", load_profile)):
        value = get(name)
        if value is None:
            continue
        try:
            lookup(value)
        except ValueError as exc:
            raise ConfigError(f"{flag_name(name)} ({env_name(name)}): {exc}") from None
