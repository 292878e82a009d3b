"""Token ids for replayed rounds: a trace gives lengths, the session API carries ids."""
from __future__ import annotations

import zlib

# Below every supported model's vocabulary (the mock's is 32,000), so replay runs on any engine.
FILLER_VOCAB = 32_000


def filler_ids(n: int, start: int = 0, vocab: int = FILLER_VOCAB) -> list[int]:
    """``n`` deterministic token ids for positions ``start``.. of a replayed input (or a replay tool's
    result), below ``vocab``; their values only matter to a real model, which reads them as text."""
    v = min(vocab, FILLER_VOCAB)
    return [((start + i) * 2_654_435_761 + 1) % v for i in range(n)]


def round_ids(n: int, start: int, hash_ids: tuple[int, ...] | None = None, block_tokens: int = 512,
              vocab: int = FILLER_VOCAB, session: str | None = None) -> list[int]:
    """A replayed round's ``n`` input ids at position ``start``. With the round's ``hash_ids`` (its
    prompt's prefix-block hashes: Mooncake's, ``block_tokens`` each) each block's ids are a function
    of its hash alone, so rounds whose prompts share hash ids share those tokens (and a decode worker
    with --prefix-sharing their KV); the tokens past the hashed blocks are fillers as without.

    Without hash ids the trace says nothing is shared, so a prompt (``start`` 0) of ``session``
    begins with two ids of its own: fillers alone are equal across sessions, and prefix sharing
    (on by default) would share every replayed prompt, which the simulator, reading the same trace,
    does not."""
    if not hash_ids:
        ids = filler_ids(n, start, vocab)
        if session is not None and start == 0 and n >= 2:
            v = min(vocab, FILLER_VOCAB)
            h = zlib.crc32(session.encode())
            ids[0], ids[1] = h % v, (h // v) % v
        return ids
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= n:
            break
        out += filler_ids(min(block_tokens, n - len(out)), 1_000_003 * (h % 1_000_003 + 1), vocab)
    return out + filler_ids(n - len(out), start + len(out), vocab)
