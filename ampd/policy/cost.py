"""The performance model's two placements of one prefill task, Eq. (1) local and Eq. (2) remote,
and its three lookups as the cores call them (``pre_s``, ``kv_s``, ``dec_s``).

Every caller (the router's cost rung and slack tests, the prefill worker core's in-service estimate,
the simulator's timing of a remote prefill) goes through these functions, so the terms and their
floating-point order are the same everywhere. Pure: no I/O, no clock.
"""
from __future__ import annotations

from ampd.perf.profile import Profile

from .types import CostModel, DecodeCost

__all__ = ["remote_parts", "remote_prefill_s", "t_remote", "t_local", "pre_s", "kv_s", "dec_s"]


# The cost model's three lookups as the cores call them. Compiled, a call through the protocol is a
# Python-level call (arguments boxed, then parsed), while on a ``Profile`` (the simulator's and the
# services' model) it is a direct C call: one type test buys that (docs/simulator.md, "Compiled
# cores"). Any other model (a test's stand-in, the simulator's SlowerSteps) takes the protocol's path.
def pre_s(cost: CostModel, tp: int, l_hist: int, l_incr: int) -> float:
    """``cost.t_pre(tp, l_hist, l_incr)``."""
    if isinstance(cost, Profile):
        return cost.t_pre(tp, l_hist, l_incr)
    return cost.t_pre(tp, l_hist, l_incr)


def kv_s(cost: CostModel, tokens: int, src_tp: int, dst_tp: int) -> float:
    """``cost.t_kv(tokens, src_tp, dst_tp)``."""
    if isinstance(cost, Profile):
        return cost.t_kv(tokens, src_tp, dst_tp)
    return cost.t_kv(tokens, src_tp, dst_tp)


def dec_s(cost: DecodeCost, tp: int, batch: int, context_tokens: int) -> float:
    """``cost.t_dec(tp, batch, context_tokens)``."""
    if isinstance(cost, Profile):
        return cost.t_dec(tp, batch, context_tokens)
    return cost.t_dec(tp, batch, context_tokens)


class _Priced:
    """One call of ``remote_parts``: its arguments and its terms (typed: compiled, a hit compares
    four ints and one identity, where a tuple key was built and compared per call)."""

    __slots__ = ("cost", "l_hist", "l_incr", "decode_tp", "prefill_tp", "parts")

    def __init__(self, cost: object, l_hist: int, l_incr: int, decode_tp: int, prefill_tp: int,
                 parts: tuple[float, float, float]) -> None:
        self.cost = cost
        self.l_hist = l_hist
        self.l_incr = l_incr
        self.decode_tp = decode_tp
        self.prefill_tp = prefill_tp
        self.parts = parts


# The last call: the router prices a task (Eq. 2) and the prefill worker it picks prices the same
# task again at submit; one entry saves that second pricing (~1/3 of the simulator's cost-model
# calls). A pure function of its arguments, so the entry is always valid; one object, replaced
# whole, so concurrent callers see a consistent entry.
_last = _Priced(None, -1, -1, -1, -1, (0.0, 0.0, 0.0))


def remote_parts(cost: CostModel, l_hist: int, l_incr: int, decode_tp: int,
                 prefill_tp: int) -> tuple[float, float, float]:
    """(history KV in, compute, new KV back) of a prefill on a ``prefill_tp`` worker for a session
    bound to a ``decode_tp`` worker; a zero-token transfer does not happen, so it costs nothing."""
    global _last
    last = _last
    if (last.l_hist == l_hist and last.l_incr == l_incr and last.decode_tp == decode_tp
            and last.prefill_tp == prefill_tp and last.cost is cost):
        return last.parts
    read = kv_s(cost, l_hist, decode_tp, prefill_tp) if l_hist else 0.0
    write = kv_s(cost, l_incr, prefill_tp, decode_tp) if l_incr else 0.0
    parts = (read, pre_s(cost, prefill_tp, l_hist, l_incr), write)
    _last = _Priced(cost, l_hist, l_incr, decode_tp, prefill_tp, parts)
    return parts


def remote_prefill_s(cost: CostModel, l_hist: int, l_incr: int, decode_tp: int, prefill_tp: int) -> float:
    """Eq. (2) without its queue term: compute + history KV in + new KV back."""
    read, comp, write = remote_parts(cost, l_hist, l_incr, decode_tp, prefill_tp)
    return comp + read + write


def t_remote(cost: CostModel, l_hist: int, l_incr: int, decode_tp: int, prefill_tp: int,
             queue_s: float) -> float:
    """Eq. (2): the worker's predicted queue (``WorkerView.queue_predicted_s``) + history KV in +
    compute + new KV back."""
    return remote_prefill_s(cost, l_hist, l_incr, decode_tp, prefill_tp) + queue_s


def t_local(cost: CostModel, l_hist: int, l_incr: int, decode_tp: int, queue_s: float) -> float:
    """Eq. (1): the decode worker's predicted local queue + compute (no KV moves)."""
    return pre_s(cost, decode_tp, l_hist, l_incr) + queue_s
