"""Binding a new session to the decode worker that holds the longest prefix of its prompt
(``--prefix-sharing`` on the decode workers; the rule is ``ampd.policy.prefixbind.rebind_prefix``,
the simulator's too).

Before admission judges a new session whose first turn has token ids, ``prefix_choice`` reads every
sharing decode worker's match for its prompt (``ampd.state.prefixes``: one pipelined round trip); when
admission has picked a worker, the ``PrefixChoice`` may move the session to a worker holding at least
``MOVE_MIN_BLOCKS`` more of its prompt blocks, where it fits (KV net of the promises) and the ITL SLO
is met; the promise is made there. A Redis that does not answer leaves admission's choice.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence

import structlog

from ampd.policy import WorkerView
from ampd.policy.prefixbind import prefix_hashes, rebind_prefix, scoped_seed
from ampd.state.prefixes import PrefixSets
from ampd.state.store import REDIS_ERRORS, WorkerInfo

__all__ = ["PrefixChoice", "prefix_choice", "prompt_hashes", "LOOKUP_TIMEOUT_S"]

log = structlog.get_logger()

LOOKUP_TIMEOUT_S = 1.0  # a lookup slower than this binds as without it
# A longer prompt is hashed in a thread (~12 us a 32-token block here: 128k tokens ~50 ms), so that
# the loop serving every other session is not held for it
THREAD_TOKENS = 16_384


def _block_tokens(info: WorkerInfo) -> int:
    """A sharing decode worker's block size, 0 for any other (or a registration without a usable one)."""
    if info.kind != "decode" or not info.prefix_sharing:
        return 0
    try:
        return max(int(info.layout.get("block_tokens", 0) or 0), 0)
    except (TypeError, ValueError, AttributeError):
        return 0


def prompt_hashes(infos: Mapping[str, WorkerInfo], tokens: Sequence[int], scope: str = "") -> dict[str, list[int]]:
    """worker id -> the hashes of the prompt blocks it could share (its block size and seed, mixed
    with the session's prefix scope as the worker mixes it: ``scoped_seed``), for the decode workers
    that share prefixes; so a session is bound only to blocks of its own scope. Pure: workers of one
    layout and model hash once."""
    out: dict[str, list[int]] = {}
    done: dict[tuple[int, int], list[int]] = {}
    for wid, info in infos.items():
        bt = _block_tokens(info)
        if bt <= 0:
            continue
        key = (bt, info.prefix_seed)
        if key not in done:
            done[key] = prefix_hashes(tokens, bt, scoped_seed(info.prefix_seed, scope))
        out[wid] = done[key]
    return out


class PrefixChoice:
    """The prompt's match on each worker and the rule that applies it to admission's choice
    (``__call__``); ``bound`` counts and logs the binding once the promise is made."""

    def __init__(self, sid: str, matched: Mapping[str, int], block_tokens: Mapping[str, int],
                 itl_slo_s: float | None, counters: Counter) -> None:
        self.sid, self.matched, self.block_tokens = sid, dict(matched), dict(block_tokens)
        self.itl_slo_s, self.counters = itl_slo_s, counters
        self.admitted = ""  # admission's choice, the last time it was asked

    def __call__(self, bound: str, decode: Sequence[WorkerView], promised: Mapping[str, int], need: int) -> str:
        """The worker for the session admission bound to ``bound`` (``need`` promised there in ``promised``)."""
        self.admitted = bound
        bt = self.block_tokens.get(bound) or max(self.block_tokens.values(), default=0)
        if bt <= 0:
            return bound
        wid, _ = rebind_prefix(bound, decode, self.matched, bt, promised, need, self.itl_slo_s)
        return wid

    def bound(self, worker: str) -> None:
        """The session is bound to ``worker``: the binding's reason, ``prefix`` or ``admission``, in
        ``ampd_session_bindings_total`` (and its shared tokens, if it moved, in
        ``ampd_prefix_bind_tokens_total``)."""
        blocks = self.matched.get(worker, 0)
        if worker != self.admitted:
            self.counters["bind_prefix"] += 1
            self.counters["bind_prefix_tokens"] += blocks * self.block_tokens.get(worker, 0)
            log.info("session bound for a prefix", session=self.sid, decode_worker=worker, reason="prefix",
                     prefix_blocks=blocks, admitted=self.admitted, admitted_blocks=self.matched.get(self.admitted, 0))
        else:
            self.counters["bind_admission"] += 1


async def prefix_choice(sets: PrefixSets, infos: Mapping[str, WorkerInfo], sid: str, tokens: Sequence[int],
                        itl_slo_s: float | None, counters: Counter, scope: str = "") -> PrefixChoice | None:
    """The PrefixChoice of a new session with prompt ``tokens`` in prefix scope ``scope``
    (OpenSession.prefix_scope); None when no decode worker shares prefixes, the prompt has no full
    block to share, or Redis did not answer (bound as without)."""
    if len(tokens) > THREAD_TOKENS:
        hashes = await asyncio.to_thread(prompt_hashes, dict(infos), tokens, scope)
    else:
        hashes = prompt_hashes(infos, tokens, scope)
    if not any(hashes.values()):
        return None
    try:
        matched = await asyncio.wait_for(sets.matches(hashes), LOOKUP_TIMEOUT_S)
    except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
        log.warning("prefix lookup failed; binding without it", session=sid, error=str(exc) or type(exc).__name__)
        return None
    bts = {w: _block_tokens(infos[w]) for w in hashes}
    return PrefixChoice(sid, matched, bts, itl_slo_s, counters)
