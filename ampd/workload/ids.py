"""Token ids for replayed rounds: a trace gives lengths, the session API carries ids."""
from __future__ import annotations

# Below every supported model's vocabulary (the mock's is 32,000), so replay runs on any engine.
FILLER_VOCAB = 32_000


def filler_ids(n: int, start: int = 0, vocab: int = FILLER_VOCAB) -> list[int]:
    """``n`` deterministic token ids for positions ``start``.. of a replayed input (or a replay tool's
    result), below ``vocab``; their values only matter to a real model, which reads them as text."""
    v = min(vocab, FILLER_VOCAB)
    return [((start + i) * 2_654_435_761 + 1) % v for i in range(n)]


def round_ids(n: int, start: int, hash_ids: tuple[int, ...] | None = None, block_tokens: int = 512,
              vocab: int = FILLER_VOCAB) -> list[int]:
    """A replayed round's ``n`` input ids at position ``start``. With the round's ``hash_ids`` (its
    prompt's prefix-block hashes: Mooncake's, ``block_tokens`` each) each block's ids are a function
    of its hash alone, so rounds whose prompts share hash ids share those tokens (and a decode worker
    with --prefix-sharing their KV); the tokens past the hashed blocks are fillers as without."""
    if not hash_ids:
        return filler_ids(n, start, vocab)
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= n:
            break
        out += filler_ids(min(block_tokens, n - len(out)), 1_000_003 * (h % 1_000_003 + 1), vocab)
    return out + filler_ids(n - len(out), start + len(out), vocab)
