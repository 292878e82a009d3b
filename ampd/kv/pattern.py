"""Deterministic KV content so that any receiver can verify every byte it got.

Byte j of position p of session s is byte (j % 8) (little-endian) of
    mix64(seed(s) + p * G + (j // 8) * H)        (all mod 2**64)
where seed(s) is an 8-byte blake2b of the session id, G and H are odd constants and mix64 is the
splitmix64 finalizer. It depends on (session, position, byte index) only, so any slice of positions
can be produced or checked on its own, on any worker, with any block layout.

With prefix sharing (``prefix_tokens``: a session's leading positions in prefix blocks, which other
sessions with the same prompt prefix may share) those positions are keyed by ``PREFIX_KEY`` instead of
the session: their KV is a function of the position alone, as a real model's is of the (equal) tokens
before it, so a block written by one session checks out when another reads it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from functools import lru_cache

import numpy as np

__all__ = ["kv_pattern", "verify_pattern", "session_seed", "PatternCache", "PREFIX_KEY"]

PREFIX_KEY = "\0prefix"  # the key of shared prefix positions (no session id is empty-prefixed with NUL)

_G = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio increment, per position
_H = np.uint64(0xD1B54A32D192ED03)  # per 8-byte word inside a position
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@lru_cache(maxsize=65536)
def session_seed(session_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little")


@lru_cache(maxsize=64)
def _word_offsets(words: int) -> np.ndarray:
    w = np.arange(words, dtype=np.uint64) * _H
    w.flags.writeable = False
    return w


def kv_pattern(session_id: str, start: int, tokens: int, bytes_per_token: int, prefix_tokens: int = 0) -> np.ndarray:
    """uint8 array of tokens*bytes_per_token bytes: the KV of positions [start, start+tokens) (those
    below ``prefix_tokens`` keyed by ``PREFIX_KEY``)."""
    start, tokens, bpt = int(start), int(tokens), int(bytes_per_token)
    if prefix_tokens > start and tokens > 0:
        n = min(tokens, int(prefix_tokens) - start)
        head = kv_pattern(PREFIX_KEY, start, n, bpt)
        return head if n == tokens else np.concatenate([head, kv_pattern(session_id, start + n, tokens - n, bpt)])
    if start < 0 or tokens < 0 or bpt <= 0:
        raise ValueError(f"kv_pattern: bad start={start} tokens={tokens} bytes_per_token={bpt}")
    if tokens == 0:
        return np.empty(0, dtype=np.uint8)
    words = -(-bpt // 8)
    pos = np.arange(start, start + tokens, dtype=np.uint64)
    pos *= _G
    pos += np.uint64(session_seed(session_id))
    x = pos[:, None] + _word_offsets(words)[None, :]  # (tokens, words) uint64, wraps mod 2**64
    # splitmix64 finalizer, in place
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    b = x.astype("<u8", copy=False).view(np.uint8)  # (tokens, words*8)
    if words * 8 != bpt:
        return np.ascontiguousarray(b[:, :bpt]).reshape(-1)
    return b.reshape(-1)


def verify_pattern(session_id: str, start: int, data: np.ndarray, bytes_per_token: int, prefix_tokens: int = 0) -> int:
    """Number of bytes of `data` that differ from kv_pattern for positions starting at `start`."""
    flat = np.asarray(data).reshape(-1).view(np.uint8)
    bpt = int(bytes_per_token)
    if bpt <= 0 or flat.nbytes % bpt:
        raise ValueError(f"verify_pattern: {flat.nbytes} bytes is not a multiple of {bpt}")
    expected = kv_pattern(session_id, start, flat.nbytes // bpt, bpt, prefix_tokens)
    return int(np.count_nonzero(expected != flat))


class PatternCache:
    """kv_pattern of sessions' first positions, kept (least recently used out beyond ``max_bytes``).

    A prefill worker checks the whole history it reads against it each round, all of which but
    the positions since the last round it computed then (the pattern of 1536 positions of 64 bytes
    took ~0.1 ms of the remote round's path). The pattern is a pure function of (session,
    position), so a kept one never goes stale. (The mock engine's own writes do not go through
    it: growing a kept pattern copies it, which cost a local round more than it saved.)
    """

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = int(max_bytes)
        # (session, bytes_per_token) -> (buffer, bytes of it computed); a buffer grows by doubling,
        # so that a session's rounds copy (and fault in) O(its pattern) in all, not each round
        self._kept: OrderedDict[tuple[str, int], tuple[np.ndarray, int]] = OrderedDict()
        self._bytes = 0  # of the buffers

    def prefix(self, session_id: str, tokens: int, bytes_per_token: int) -> np.ndarray:
        """kv_pattern(session_id, 0, tokens, bytes_per_token), read-only."""
        key, bpt = (session_id, int(bytes_per_token)), int(bytes_per_token)
        need = int(tokens) * bpt
        kept = self._kept.pop(key, None)
        buf, have = kept if kept is not None else (np.empty(0, dtype=np.uint8), 0)
        self._bytes -= buf.nbytes
        if have < need:
            if need > buf.nbytes:
                grown = np.empty(max(need, min(2 * buf.nbytes, self.max_bytes)), dtype=np.uint8)
                grown[:have] = buf[:have]
                buf = grown
            buf[have:need] = kv_pattern(session_id, have // bpt, (need - have) // bpt, bpt)
            have = need
        if buf.nbytes <= self.max_bytes:
            self._kept[key] = (buf, have)
            self._bytes += buf.nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._kept.popitem(last=False)[1][0].nbytes
        out = buf[:need]  # what is computed is never written again: a view stays valid
        out.flags.writeable = False
        return out

    def pattern(self, session_id: str, start: int, tokens: int, bytes_per_token: int) -> np.ndarray:
        """kv_pattern(session_id, start, tokens, bytes_per_token), read-only; kept (with all the
        positions before it) when they fit in ``max_bytes``."""
        start, tokens, bpt = int(start), int(tokens), int(bytes_per_token)
        if start < 0 or (start + tokens) * bpt > self.max_bytes:
            return kv_pattern(session_id, start, tokens, bpt)
        return self.prefix(session_id, start + tokens, bpt)[start * bpt:]

    def verify(self, session_id: str, data: np.ndarray, bytes_per_token: int, prefix_tokens: int = 0) -> int:
        """verify_pattern(session_id, 0, data, bytes_per_token, prefix_tokens): positions from 0."""
        flat = np.asarray(data).reshape(-1).view(np.uint8)
        bpt = int(bytes_per_token)
        if bpt <= 0 or flat.nbytes % bpt:
            raise ValueError(f"verify_pattern: {flat.nbytes} bytes is not a multiple of {bpt}")
        n = flat.nbytes // bpt
        p = min(int(prefix_tokens), n)
        bad = int(np.count_nonzero(self.pattern(PREFIX_KEY, 0, p, bpt) != flat[:p * bpt])) if p else 0
        return bad + int(np.count_nonzero(self.pattern(session_id, p, n - p, bpt) != flat[p * bpt:]))
