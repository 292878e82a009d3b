"""How many tokens a round is expected to make: a windowed mean of the rounds that ended lately,
the agent's ``expected_output_tokens`` hint, and the round's ``max_tokens``.

``max_tokens`` is a bound: every decision whose safety rests on it (admission's KV promise, the
decode worker's reservation) keeps counting it. This estimate is for the decisions that predict
time from a round's output, where the bound overstates it: the ``slo`` admission rule's ITL
prediction counts a new session's context at its expected KV (``ampd.policy.admit.predicted_itl``).

The estimate of a round is ``min(max_tokens, max(hint, mean))``: a hint may raise it above the
windowed mean, never lower it, and nothing claims more than the round may make. With no rounds in
the window it is ``max_tokens`` (the bound, what every decision counted before), hint or not. So a
hint only makes its own round look costlier: under the ``slo`` rule its own session's predicted ITL
rises and it may be refused (its own loss), while every other session is judged exactly as with
no hint (a hostile 1-token hint changes nothing). The windowed mean itself is no hint: it is what
the rounds served made (``RoundTiming.tokens``), fed alike by the coordinator
(services/coordinator/admission.py) and the simulator (``ampd.sim``).

Pure: time is passed in.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ampd.window import WindowedMean

__all__ = ["OutputLengths", "OutputLengthsConfig", "expected_output", "rounds_kv_tokens"]


@dataclass(slots=True)
class OutputLengthsConfig:
    """``window_s``: how far back the mean looks. Rounds end about as often as tool calls do, so the
    window is the per-tool durations' (``ampd.policy.tooldur``), minutes, not the ITL's seconds."""

    window_s: float = 300.0


class OutputLengths:
    """Windowed mean of the tokens the rounds that ended lately made."""

    __slots__ = ("cfg", "_mean")

    def __init__(self, cfg: OutputLengthsConfig | None = None) -> None:
        self.cfg = cfg or OutputLengthsConfig()
        self._mean = WindowedMean(self.cfg.window_s)

    def observe(self, now: float, tokens: int) -> None:
        """A round that made ``tokens`` tokens ended at ``now``. A round that made none (cancelled
        before its first token) says nothing about output lengths."""
        if tokens > 0:
            self._mean.add(now, float(tokens))

    def mean(self, now: float) -> float | None:
        """The mean at ``now``; None when no round ended within the window."""
        return self._mean.mean(now)


def expected_output(max_tokens: int, hint: int | None, mean: float | None) -> int:
    """The tokens a round of at most ``max_tokens`` is expected to make, given its hint (None: none)
    and the windowed ``mean`` (None: no estimate, so the bound)."""
    if mean is None:
        return max_tokens
    est = math.ceil(mean)
    if hint is not None and hint > est:
        est = hint
    return est if est < max_tokens else max_tokens


def rounds_kv_tokens(rounds: Iterable[tuple[int, int]], hint: int | None = None, mean: float | None = None) -> int:
    """The KV tokens ``rounds`` add to a session, each round given as (its input tokens, its output
    bound ``max_tokens``): without a ``mean``, every output at its bound (admission's promise); with
    the windowed ``mean``, the KV they are expected to add, each output at ``expected_output`` with
    the rounds' ``hint``. The coordinator's ``turn_kv_tokens`` (a turn's rounds) and the simulator's
    admission (a replayed session's rounds) both count by it."""
    if mean is None:
        return sum(i + b for i, b in rounds)
    return sum(i + expected_output(b, hint, mean) for i, b in rounds)
