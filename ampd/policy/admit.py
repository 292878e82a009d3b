"""Admission of a new session: the decode worker that takes it, or why it waits, or why it is refused.

Three rules (``ampd.config`` ``admission``; docs/security.md):

- ``none``: every session is accepted at once, on the decode worker with the least KV promised
  (``bind`` with no need); its rounds wait for KV there if they must (the decode worker's
  ``kv_admission``). What the simulator did before it drove this core; its tests of the decode
  worker's own KV admission use it.

- ``kv``: a session is admitted when some decode worker can hold all the KV it may need, net of what
  is promised to the sessions in flight there (``bind``); otherwise it waits for KV to free. A worker
  with a host KV tier holds its device pool plus as much of its host pool as KV idle in tool calls
  can really free on the device (``promise_room``, by the windowed ``ampd.policy.offshare``
  estimate: none without one), up to device + host.
- ``slo``: the ``kv`` rule, and the session must be able to meet its SLO on the worker it would get:
  its predicted TTFT (what it has waited already, plus Eq. (1) on that decode worker or Eq. (2) on the
  best prefill worker, queues included) within ``TTFT_FRACTION`` of the TTFT SLO, and that decode
  worker's predicted ITL with one more session within the ITL SLO (which counts the new session's
  context at its expected KV: its rounds' outputs by ``ampd.policy.outlen``, the windowed mean
  raised by an ``expected_output_tokens`` hint, at most ``max_tokens``; not at its promise). A
  session that cannot is refused at once (waiting only adds to its TTFT: the queue ahead of it
  drains no faster than it waits), and a session waiting for KV waits no longer than what is left
  of its TTFT budget.

Pure: no I/O, no clock. The caller passes what the session has waited (``waited_s``) and the workers'
views. ``decide`` judges one session; ``AdmissionBook`` keeps what admission remembers between
judgements (the KV promised and the sessions admitted per decode worker, the sessions waiting and
who goes first) and applies the admission wait and queue bound. Two drivers run the same book: the
coordinator's ``Admission`` (services/coordinator/admission.py, asyncio: it sleeps and wakes) and
the simulator (``ampd.sim``, virtual clock: timed events).
"""
from __future__ import annotations

from typing import Final
import math
from collections import Counter, deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from .bind import bind
from .cost import dec_s, t_local, t_remote
from .offshare import OffDeviceShare
from .order import worker_key
from .outlen import OutputLengths
from .route import ALPHA
from .types import SLO, DecodeCost, WorkerView

__all__ = ["AdmissionBook", "ADMISSION_RULES", "REFUSAL_REASONS", "KV_SIZE", "KV_FULL", "QUEUE_FULL", "TTFT", "ITL",
           "TTFT_FRACTION", "HEAD_POLL_S", "Verdict", "decide", "promise_room", "promise_rooms", "predicted_itl", "predicted_ttft"]

ADMISSION_RULES = ("kv", "slo", "none")

# Why a session was refused (RESOURCE_EXHAUSTED), the label of the coordinator's refusal counter.
KV_SIZE: Final = "kv-size"  # it may need more KV than any decode worker holds
KV_FULL: Final = "kv-full"  # no decode worker had its KV within the admission wait (or the wait is 0)
QUEUE_FULL: Final = "queue-full"  # admission_queue sessions already wait
TTFT: Final = "ttft"  # (slo) its predicted TTFT is over the SLO, or would be by the time KV frees
ITL: Final = "itl"  # (slo) the decode worker's predicted ITL with it is over the SLO
REFUSAL_REASONS = (KV_SIZE, KV_FULL, QUEUE_FULL, TTFT, ITL)

# The share of the TTFT SLO a new session's predicted TTFT may take: the router's slack factor
# (Algorithm 1's alpha), leaving room for what the prediction does not see (sessions admitted an
# instant ago whose prefill is not yet queued, the hops between services).
TTFT_FRACTION = ALPHA
# How often the head of the admission queue looks again without a release (a new worker may have
# joined, the slo rule's verdict may change): the coordinator's poll, and the simulator's.
HEAD_POLL_S: Final = 0.5

_WAIT_EPS_S = 1e-9  # a wait this short is over


@dataclass(slots=True, init=False)
class Verdict:
    """``worker``: admitted there. Else ``reason`` (one of REFUSAL_REASONS): refused, ``detail`` says
    why in words. Else it waits, at most ``wait_s`` more seconds before it is judged again (inf: the
    caller's own admission wait bounds it). ``ttft_s``/``itl_s``: the predictions compared (slo)."""

    worker: str | None = None
    reason: str = ""
    detail: str = ""
    wait_s: float = math.inf
    ttft_s: float | None = None
    itl_s: float | None = None

    # (written out: compiled, a dataclass's generated __init__ runs as interpreted Python; tests/unit/test_inits.py
    # holds it to the fields)
    def __init__(self, worker: str | None = None, reason: str = "", detail: str = "", wait_s: float = math.inf,
                 ttft_s: float | None = None, itl_s: float | None = None) -> None:
        self.worker = worker
        self.reason = reason
        self.detail = detail
        self.wait_s = wait_s
        self.ttft_s = ttft_s
        self.itl_s = itl_s


def predicted_ttft(cost: DecodeCost, decode: WorkerView, prefills: Sequence[WorkerView], l_incr: int,
                   waited_s: float) -> float:
    """A new session's TTFT if bound to ``decode``: what it waited, plus its first prefill (``l_incr``
    tokens, no history) on the better of Eq. (1) there and Eq. (2) on each prefill worker, each with
    its published queue (what the adaptive router compares on its cost rung)."""
    best = t_local(cost, 0, l_incr, decode.tp, decode.queue_predicted_s)
    for p in prefills:
        best = min(best, t_remote(cost, 0, l_incr, decode.tp, p.tp, p.queue_predicted_s))
    return waited_s + best


def predicted_itl(cost: DecodeCost, decode: WorkerView, sessions: int, context_tokens: int, need: int) -> float:
    """``decode``'s ITL with one more session: its windowed ITL (the model's step for the batch with
    it when the window is empty) plus what one more sequence of ``need`` context tokens adds to a
    step (``t_dec``; ``decide`` passes the new session's expected KV). ``sessions`` and
    ``context_tokens``: the sessions admitted there and the KV promised to them, an upper bound of
    its batch (sessions in tool calls are not decoding)."""
    after = dec_s(cost, decode.tp, sessions + 1, context_tokens + need)
    if decode.window_mean_s is None:
        return after
    return decode.window_mean_s + after - dec_s(cost, decode.tp, sessions, context_tokens)


def promise_room(w: WorkerView, host_share: float | None, need: int) -> int:
    """The KV a decode worker may be promised: its device pool (``kv_free_tokens``), plus as much of
    its host KV tier (``kv_host_tokens``) as can really stand in for device room.

    KV is on host only while its session is idle in a tool call worth an offload
    (``ampd.policy.offshare``); ``host_share`` is the share of the admitted KV's time spent so. With
    promises P on a worker, about ``host_share`` * P can be on host at once and the rest, (1 -
    share) * P, needs the device D: P may reach D / (1 - share). That is a mean; few large sessions
    stray from it (one more busy than the mean says, and a round waits for its KV behind the
    others' moves), so one session's worth (``need``, the session being judged) is kept back from
    what the idle KV covers: the host stands in for (share * D - need) / (1 - share) tokens, at
    most the host pool, at least none. With short tool calls (share near 0), or no estimate
    (None), the promise is the device's; with long ones it reaches device + host.

    Bounds, whatever the estimate: the promise never exceeds device + host (a session idle in a
    tool call holds no device KV another round needs: the decode core moves it to the host, or, the
    host full, drops it to be re-prefilled, before a round waits), and a session's whole KV must
    fit the device (``kv-size`` counts the device only)."""
    device, host = w.kv_free_tokens, w.kv_host_tokens
    if not host or host_share is None or host_share <= 0:
        return device
    if host_share >= 1:
        return device + host
    extra = (host_share * device - need) / (1.0 - host_share)
    return device + min(host, max(0, int(extra)))


def promise_rooms(decode: Sequence[WorkerView], host_share: float | None, need: int) -> Sequence[WorkerView]:
    """``decode`` with each worker's ``kv_free_tokens`` its room for promises (``promise_room``)
    and ``kv_host_tokens`` 0. Workers without a tier are returned as they are."""
    if not any(w.kv_host_tokens for w in decode):
        return decode
    # positional, in WorkerView's field order (worker_id, kind, tp, window_mean_s, queue,
    # kv_free_tokens, queue_predicted_s, kv_host_tokens; test_admit.py pins it): keywords cost ~3x
    # more, dataclasses.replace ~10x, and the simulator judges admission per arrival (~5x that when
    # overloaded)
    return [WorkerView(w.worker_id, w.kind, w.tp, w.window_mean_s, w.queue, promise_room(w, host_share, need),
                       w.queue_predicted_s, 0) if w.kv_host_tokens else w for w in decode]


def decide(rule: str, decode: Sequence[WorkerView], prefills: Sequence[WorkerView], promised: Mapping[str, int],
           sessions: Mapping[str, int], need: int, l_incr: int, waited_s: float, cost: DecodeCost | None,
           slo: SLO | None, host_share: float | None = None, expect: int | None = None) -> Verdict:
    """Admit, refuse or wait, for a session that may need ``need`` KV tokens and whose first prefill
    has ``l_incr`` tokens, having waited ``waited_s`` seconds. ``expect``: the KV it is expected to
    hold (``ampd.policy.outlen``; None: ``need``), its context in the ``slo`` rule's ITL prediction.
    ``decode``: the live decode workers, ``kv_free_tokens`` being each one's capacity;
    ``promised``/``sessions``: per decode worker, the KV promised to and the number of the sessions
    admitted there. ``cost`` and ``slo`` are needed by the ``slo`` rule only. Raises ValueError on an unknown rule or an empty ``decode``."""
    if rule not in ADMISSION_RULES:
        raise ValueError(f"admission rule must be one of {', '.join(ADMISSION_RULES)}, got {rule!r}")
    if not decode:
        raise ValueError("admission: no decode worker")
    if rule == "none":
        return Verdict(worker=bind(decode, promised))
    biggest = max(w.kv_free_tokens for w in decode)
    if need > biggest:
        return Verdict(reason=KV_SIZE, detail=f"the session may need {need} KV tokens, more than any decode "
                                              f"worker holds ({biggest})")
    decode = promise_rooms(decode, host_share, need)
    if rule == "kv":
        chosen = bind(decode, promised, need)
        return Verdict(worker=chosen) if chosen is not None else Verdict()
    if cost is None or slo is None:
        raise ValueError("admission rule 'slo' needs the cost model and the SLO")
    limit = TTFT_FRACTION * slo.ttft_s
    # the workers with room, in bind's order (most KV left first, ties in the worker order)
    room = sorted((w for w in decode if w.kv_free_tokens - promised.get(w.worker_id, 0) >= need),
                  key=lambda w: (-(w.kv_free_tokens - promised.get(w.worker_id, 0)), worker_key(w.worker_id)))
    if not room:  # wait for KV, as long as the TTFT budget lasts on the best worker
        ttft = min(predicted_ttft(cost, w, prefills, l_incr, waited_s) for w in decode)
        if ttft > limit:
            return Verdict(reason=TTFT, ttft_s=ttft,
                           detail=f"no decode worker has KV for {need} tokens, and after {waited_s:.2f} s of "
                                  f"waiting the predicted TTFT {ttft:.2f} s is over {limit:.2f} s "
                                  f"({TTFT_FRACTION:g} of the TTFT SLO)")
        return Verdict(wait_s=limit - ttft, ttft_s=ttft)
    first: Verdict | None = None
    for w in room:
        ttft = predicted_ttft(cost, w, prefills, l_incr, waited_s)
        itl = predicted_itl(cost, w, sessions.get(w.worker_id, 0), promised.get(w.worker_id, 0),
                            need if expect is None else expect)
        if ttft <= limit and itl <= slo.itl_s:
            return Verdict(worker=w.worker_id, ttft_s=ttft, itl_s=itl)
        if first is None:
            if ttft > limit:
                first = Verdict(reason=TTFT, ttft_s=ttft, itl_s=itl,
                                detail=f"predicted TTFT {ttft:.2f} s on {w.worker_id} (after {waited_s:.2f} s "
                                       f"of waiting, prefill queues included) is over {limit:.2f} s "
                                       f"({TTFT_FRACTION:g} of the TTFT SLO)")
            else:
                first = Verdict(reason=ITL, ttft_s=ttft, itl_s=itl,
                                detail=f"predicted ITL {itl * 1e3:.1f} ms on {w.worker_id} with one more "
                                       f"session is over the ITL SLO {slo.itl_s * 1e3:.1f} ms")
    assert first is not None  # room is not empty: the loop judged a worker
    return first


class AdmissionBook:
    """Admission's state and its one procedure, for both drivers.

    A session that cannot be admitted now waits, in a queue of at most ``queue_max``, at most
    ``wait_s`` seconds from its arrival (``slo``: no longer than its TTFT budget lasts), then is
    refused. ``kv``: first come, first served. ``slo``: newest first; a new session goes ahead of the
    waiting ones (it has the most TTFT budget left; under overload the oldest would miss its TTFT
    anyway, and is refused when its budget is spent). A waiting session is a ``ticket`` (any
    hashable the driver picks); after a final verdict (admitted or refused), or when it gives up,
    the driver calls ``leave``. When KV frees (``release``) or the head leaves, the driver judges the
    head again (``head``). A session accepted is never refused later: ``new=False`` (a later binding
    of it) applies the KV rule only (``none``: none), and ``add`` promises its later turns.

    Agent hints (``ampd.policy.hints``): a session whose turn yields (a negative priority) passes
    ``order_at``, its arrival made later (``queue_enqueued_at``). It waits behind every session that
    does not yield, and behind the yielding ones of an earlier ``order_at``; it is not admitted at
    once while any other session waits. A session that does not yield is judged exactly as without
    hints (yielding ones never stand ahead of it), so a hint can only cost its own session."""

    def __init__(self, rule: str = "kv", wait_s: float = 5.0, queue_max: int = 256,
                 cost: DecodeCost | None = None, slo: SLO | None = None) -> None:
        if rule not in ADMISSION_RULES:
            raise ValueError(f"admission rule must be one of {', '.join(ADMISSION_RULES)}, got {rule!r}")
        if rule == "slo" and (cost is None or slo is None):
            raise ValueError("admission rule 'slo' needs the cost model and the SLO")
        self.rule, self.wait_s, self.queue_max, self.cost, self.slo = rule, wait_s, queue_max, cost, slo
        self.promised: Counter[str] = Counter()  # decode worker -> KV tokens promised to its live sessions
        self.sessions: Counter[str] = Counter()  # decode worker -> sessions admitted there, live
        self.waiting: deque = deque()  # tickets, the head first
        self.yielded: dict[Hashable, float] = {}  # waiting tickets that yield (hints) -> their order_at
        # how much of a host KV tier stands in for device room (promise_room): the drivers feed it
        # their rounds and pass its share(now) to judge
        self.off_device = OffDeviceShare()
        # how many tokens a round makes (the slo rule's expected KV, ampd.policy.outlen): the drivers
        # feed it their rounds and pass the expected KV they derive from its mean(now) to judge
        self.outputs = OutputLengths()

    @property
    def head(self) -> Hashable | None:
        return self.waiting[0] if self.waiting else None

    def judge(self, ticket: Hashable, need: int, l_incr: int, waited_s: float, decode: Sequence[WorkerView],
              prefills: Sequence[WorkerView], new: bool = True, order_at: float | None = None,
              host_share: float | None = None, expect: int | None = None) -> Verdict:
        """The verdict for ``ticket``, a session that may need ``need`` KV tokens and has waited
        ``waited_s`` seconds since it arrived: admitted (``worker``, ``need`` promised there),
        refused (``reason``), or waiting (``wait_s``: judge it again by then at the latest; it is in
        ``waiting`` now). ``decode``: the decode workers, each with its KV capacity as
        ``kv_free_tokens`` and its host tier as ``kv_host_tokens``; ``order_at``: set when the session
        yields (see the class doc); ``host_share``: ``off_device.share`` now (``promise_room``);
        ``expect``: the KV it is expected to hold (``decide``; None: ``need``). Raises ValueError on an
        empty ``decode``."""
        queued = ticket in self.waiting
        # a waiting session ahead of this one takes what frees first (slo: a new one goes ahead)
        if queued or (order_at is None and not self.yielded):
            ahead = bool(self.waiting) and self.waiting[0] is not ticket and not (self.rule == "slo" and not queued)
        elif order_at is None:  # yielding sessions wait behind it
            ahead = self.rule != "slo" and any(t not in self.yielded for t in self.waiting)
        else:
            ahead = bool(self.waiting)  # a yielding session goes after every waiting one
        v = decide(self.rule if new or self.rule == "none" else "kv", decode, prefills, self.promised, self.sessions, need, l_incr,
                   waited_s, self.cost, self.slo, host_share, expect)
        if v.reason:
            return v
        if v.worker is not None and not ahead:
            self.promised[v.worker] += need
            self.sessions[v.worker] += 1
            return v
        if not queued:
            if self.wait_s <= 0 or len(self.waiting) >= self.queue_max:
                return Verdict(reason=KV_FULL if self.wait_s <= 0 else QUEUE_FULL,
                               detail=f"no decode worker has KV for {need} tokens now, and "
                                      + ("admission does not wait" if self.wait_s <= 0 else
                                         f"{self.queue_max} sessions already wait"))
            self._enqueue(ticket, order_at)
        left = self.wait_s - waited_s
        if left <= _WAIT_EPS_S:  # (a float deadline: "now + left" may round back to now)
            return Verdict(reason=KV_FULL, detail=f"no decode worker had KV for {need} tokens within "
                                                  f"{self.wait_s:g} s")
        return Verdict(wait_s=min(left, v.wait_s), ttft_s=v.ttft_s)

    def _enqueue(self, ticket: Hashable, order_at: float | None) -> None:
        """Into ``waiting``: ``kv`` last, ``slo`` first, but ahead of every yielding session; a yielding
        one (``order_at``) among the yielding ones by ``order_at``, after those of the same."""
        w = self.waiting
        if order_at is None:
            if not self.yielded:  # (no hints: the rule's own order)
                w.appendleft(ticket) if self.rule == "slo" else w.append(ticket)
                return
            w.insert(0 if self.rule == "slo" else next(i for i, t in enumerate(w) if t in self.yielded), ticket)
            return
        i = len(w)
        while i > 0 and w[i - 1] in self.yielded and self.yielded[w[i - 1]] > order_at:
            i -= 1
        w.insert(i, ticket)
        self.yielded[ticket] = order_at

    def leave(self, ticket: Hashable) -> bool:
        """``ticket`` no longer waits; True when it was the head (the next one is judged then)."""
        self.yielded.pop(ticket, None)
        if not self.waiting:
            return False
        head = self.waiting[0] is ticket
        try:
            self.waiting.remove(ticket)
        except ValueError:
            return False
        return head

    def add(self, worker: str, tokens: int) -> None:
        """A later turn of an accepted session: it is not refused, but its KV is promised too."""
        self.promised[worker] += tokens

    def release(self, worker: str, tokens: int) -> None:
        """A session ended (or left ``worker``): its promise is free for the waiting ones."""
        self.promised[worker] -= tokens
        if self.promised[worker] <= 0:
            del self.promised[worker]
        self.sessions[worker] -= 1
        if self.sessions[worker] <= 0:
            del self.sessions[worker]
