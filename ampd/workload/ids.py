"""Token ids for replayed rounds: a trace gives lengths, the session API carries ids."""
from __future__ import annotations

# Below every supported model's vocabulary (the mock's is 32,000), so replay runs on any engine.
FILLER_VOCAB = 32_000


def filler_ids(n: int, start: int = 0, vocab: int = FILLER_VOCAB) -> list[int]:
    """``n`` deterministic token ids for positions ``start``.. of a replayed input (or a replay tool's
    result), below ``vocab``; their values only matter to a real model, which reads them as text."""
    v = min(vocab, FILLER_VOCAB)
    return [((start + i) * 2_654_435_761 + 1) % v for i in range(n)]
