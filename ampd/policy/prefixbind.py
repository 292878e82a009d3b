"""Binding with prefix sharing: prefer the decode worker that holds the longest prefix of a new
session's prompt, when that does not cost the SLO; otherwise the plain binding (``bind``).

Pure. ``block_hashes`` names a prompt's blocks; ``matched`` maps a worker id to how many leading prompt blocks it holds
(the simulator: ``ampd.policy.prefixindex.PrefixIndex.match``; live: the worker's published set of block hashes,
``ampd.state.prefixes``). ``rebind_prefix`` is the one rule both apply to admission's choice (``MOVE_MIN_BLOCKS``).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

from .bind import bind
from .order import before
from .types import WorkerView

__all__ = ["bind_prefix", "block_hashes", "prefix_hashes", "prefix_seed", "scoped_seed", "rebind_prefix", "leading",
           "MOVE_MIN_BLOCKS"]

# Binding leaves admission's worker for a longer prefix only when it saves this many more blocks
# there: a short common prefix (a system prompt) is not worth unbalancing the workers for
# (benchmarks/prefix_sharing.py measured the pull of every session onto one worker).
MOVE_MIN_BLOCKS = 4

_HASH = struct.Struct("<Q")


def block_hashes(tokens: Sequence[int], block_tokens: int, seed: int = 0) -> list[int]:
    """Chained 64-bit hashes of the full ``block_tokens``-token blocks of ``tokens``: block i's hash
    covers its tokens and block i-1's hash, so equal hashes mean equal whole prefixes. A partial last
    block has none (it is never shared). ``seed`` names what else the KV depends on (the model)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    out: list[int] = []
    prev = seed & 0xFFFFFFFFFFFFFFFF
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(_HASH.pack(prev), digest_size=8)
        h.update(struct.pack(f"<{block_tokens}I", *tokens[start:start + block_tokens]))
        prev = int.from_bytes(h.digest(), "little")
        out.append(prev)
    return out


def prefix_hashes(tokens: Sequence[int], block_tokens: int, seed: int = 0) -> list[int]:
    """Hashes of the prompt blocks a session could share: its full blocks, less any that would
    leave nothing to prefill (a round's prefill computes at least its last input token)."""
    n = max(len(tokens) - 1, 0) // block_tokens
    return block_hashes(tokens[:n * block_tokens], block_tokens, seed)


def prefix_seed(model: str) -> int:
    """The seed of a model's block hashes (``block_hashes``): KV of equal tokens differs between
    models. The mock engine (no model name) has 0."""
    if not model:
        return 0
    return int.from_bytes(hashlib.blake2b(model.encode(), digest_size=8).digest(), "little")


def scoped_seed(seed: int, scope: str) -> int:
    """The seed of the block hashes of a session in prefix scope ``scope`` (OpenSession.prefix_scope)
    on a worker whose model seed is ``seed`` (``prefix_seed``): blocks of different scopes never have
    equal hashes, so they are never shared across scopes (a shared block shows in another session's
    cached tokens and TTFT: a side channel between tenants). The empty scope, the deployment's shared
    one, keeps ``seed`` itself. The decode worker and the coordinator's binding both hash with it."""
    if not scope:
        return seed
    h = hashlib.blake2b(_HASH.pack(seed & 0xFFFFFFFFFFFFFFFF), digest_size=8, person=b"ampd-scope")
    h.update(scope.encode())
    return int.from_bytes(h.digest(), "little")


def bind_prefix(decode_workers: Sequence[WorkerView], matched: Mapping[str, int], block_tokens: int,
                promised: Mapping[str, int] | None = None, need: int = 0,
                itl_slo_s: float | None = None) -> tuple[str | None, int]:
    """(worker id, shared blocks there). The worker with the most matched blocks wins among those
    where the session fits (free KV net of ``promised`` >= ``need`` less the shared tokens, which
    it does not allocate again) and whose windowed ITL is under ``itl_slo_s`` (a worker missing its
    ITL SLO gains no session for a cache hit). Ties go to the most free KV, then the worker order.
    With no match anywhere, ``bind``'s choice and 0."""
    promised = promised or {}
    best: WorkerView | None = None
    best_key: tuple[int, int] = (0, 0)
    for w in decode_workers:
        m = matched.get(w.worker_id, 0)
        if m <= 0:
            continue
        free = w.kv_free_tokens - promised.get(w.worker_id, 0)
        if need > 0 and free < need - m * block_tokens:
            continue
        if itl_slo_s is not None and w.window_mean_s is not None and w.window_mean_s >= itl_slo_s:
            continue
        key = (m, free)
        if best is None or key > best_key or (key == best_key and before(w.worker_id, best.worker_id)):
            best, best_key = w, key
    if best is not None:
        return best.worker_id, best_key[0]
    return bind(decode_workers, promised, need), 0


def rebind_prefix(bound: str, decode_workers: Sequence[WorkerView], matched: Mapping[str, int], block_tokens: int,
                  promised: Mapping[str, int], need: int, itl_slo_s: float | None = None,
                  move_min_blocks: int = MOVE_MIN_BLOCKS) -> tuple[str, int]:
    """(worker id, shared blocks there) for a new session admission bound to ``bound`` (``need``
    promised there already, in ``promised``): ``bound`` unless another worker holds at least
    ``move_min_blocks`` more leading blocks of its prompt; then ``bind_prefix``'s choice with the
    promise taken off ``bound`` (``bound`` again when it picks none). The simulator and the live
    coordinator both bind by it."""
    here = matched.get(bound, 0)
    if max(matched.values(), default=0) - here < move_min_blocks:
        return bound, here
    rest = dict(promised)
    rest[bound] = rest.get(bound, 0) - need
    wid, _ = bind_prefix(decode_workers, matched, block_tokens, rest, need, itl_slo_s)
    wid = wid or bound
    return wid, matched.get(wid, 0)


def leading(found: Sequence[object]) -> int:
    """How many of ``found`` (one truth value a prompt block, in order: is it held?) lead before
    the first that is not: the blocks a worker can share (a later one held alone is no use)."""
    n = 0
    for f in found:
        if not f:
            break
        n += 1
    return n
