"""KV pool: fixed-size blocks in one pre-touched numpy uint8 buffer, and per-session block maps.

Pure in-process bookkeeping, no I/O. The buffer's address is what `NixlTransport` registers with NIXL,
so it must never move: the pool allocates it once and never resizes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

__all__ = [
    "Segment",
    "PoolLayout",
    "KVPoolExhausted",
    "KVPool",
    "SessionKV",
    "segments_tokens",
    "segments_to_arrays",
]


@dataclass(frozen=True, slots=True)
class Segment:
    """`tokens` consecutive token positions starting at position `offset` inside block `block`."""

    block: int
    offset: int
    tokens: int

    def to_list(self) -> list[int]:
        return [self.block, self.offset, self.tokens]

    @classmethod
    def from_list(cls, v: Sequence[int]) -> "Segment":
        b, o, t = v
        return cls(int(b), int(o), int(t))


def segments_tokens(segments: Iterable[Segment]) -> int:
    """Total tokens covered by `segments`."""
    return sum(s.tokens for s in segments)


def segments_to_arrays(segments: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block, offset, tokens) as three int64 arrays."""
    n = len(segments)
    b = np.fromiter((s.block for s in segments), dtype=np.int64, count=n)
    o = np.fromiter((s.offset for s in segments), dtype=np.int64, count=n)
    t = np.fromiter((s.tokens for s in segments), dtype=np.int64, count=n)
    return b, o, t


@dataclass(frozen=True)
class PoolLayout:
    """Where a pool lives in its process's memory and how it is cut; published in Redis by workers."""

    base_addr: int
    num_blocks: int
    block_tokens: int
    bytes_per_token: int

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    def to_dict(self) -> dict[str, int]:
        return {
            "base_addr": self.base_addr,
            "num_blocks": self.num_blocks,
            "block_tokens": self.block_tokens,
            "bytes_per_token": self.bytes_per_token,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PoolLayout":
        try:
            return cls(
                base_addr=int(d["base_addr"]),
                num_blocks=int(d["num_blocks"]),
                block_tokens=int(d["block_tokens"]),
                bytes_per_token=int(d["bytes_per_token"]),
            )
        except KeyError as e:
            raise ValueError(f"PoolLayout: missing field {e.args[0]!r}") from None

    def check_segments(self, segments: Sequence[Segment], what: str = "segment") -> None:
        """Raise ValueError naming the first segment that does not lie inside this layout."""
        if not segments:
            return
        self.check_arrays(*segments_to_arrays(segments), what=what)

    def check_arrays(
        self,
        b: np.ndarray,
        o: np.ndarray,
        t: np.ndarray,
        *,
        what: str = "segment",
    ) -> None:
        """check_segments on (block, offset, tokens) arrays from segments_to_arrays."""
        bad = (b < 0) | (b >= self.num_blocks) | (o < 0) | (t < 0) | (o + t > self.block_tokens)
        if bad.any():
            i = int(np.argmax(bad))
            seg = Segment(int(b[i]), int(o[i]), int(t[i]))  # whatever the caller's segments are
            raise ValueError(
                f"{what} {i} {seg} outside layout "
                f"(num_blocks={self.num_blocks}, block_tokens={self.block_tokens})"
            )

    def byte_offsets(self, seg: Segment) -> tuple[int, int]:
        """(start, end) byte offsets of `seg` from base_addr."""
        start = (seg.block * self.block_tokens + seg.offset) * self.bytes_per_token
        return start, start + seg.tokens * self.bytes_per_token


class KVPoolExhausted(Exception):
    """Not enough free blocks; `needed` and `free` are block counts."""

    def __init__(self, needed: int, free: int, block_tokens: int | None = None):
        self.needed = needed
        self.free = free
        self.block_tokens = block_tokens
        msg = f"KV pool exhausted: needed {needed} blocks, {free} free"
        if block_tokens:
            msg += f" ({needed * block_tokens} tokens needed, {free * block_tokens} free)"
        super().__init__(msg)


class Reclaimer(Protocol):
    """Holds allocated blocks it can give back when the pool is short (a prefix cache:
    ``ampd.policy.prefixindex.PrefixIndex``)."""

    @property
    def cached_blocks(self) -> int: ...

    def reclaim(self, n_blocks: int) -> list[int]: ...


class KVPool:
    """`num_blocks` blocks of `block_tokens` tokens of `bytes_per_token` bytes in one uint8 buffer.

    ``reclaimer`` (optional): blocks it caches count as available (``available_tokens``), and an
    ``alloc`` the free blocks do not cover takes them back first (least recently used first)."""

    def __init__(self, num_blocks: int, block_tokens: int, bytes_per_token: int):
        for name, v in (
            ("num_blocks", num_blocks),
            ("block_tokens", block_tokens),
            ("bytes_per_token", bytes_per_token),
        ):
            if int(v) <= 0:
                raise ValueError(f"KVPool: {name} must be > 0, got {v}")
        self.num_blocks = int(num_blocks)
        self.block_tokens = int(block_tokens)
        self.bytes_per_token = int(bytes_per_token)
        self.block_bytes = self.block_tokens * self.bytes_per_token
        self.buffer = np.empty(self.num_blocks * self.block_bytes, dtype=np.uint8)
        # Pre-touch every page: the first remote write/read must not pay page faults.
        self.buffer.fill(0)
        self.layout = PoolLayout(
            base_addr=int(self.buffer.ctypes.data),
            num_blocks=self.num_blocks,
            block_tokens=self.block_tokens,
            bytes_per_token=self.bytes_per_token,
        )
        # Stack of free blocks; popping from the end hands out low block ids first.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._used = np.zeros(self.num_blocks, dtype=bool)
        self.reclaimer: Reclaimer | None = None

    # --- capacity -------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.block_tokens

    @property
    def available_tokens(self) -> int:
        """Free tokens plus what the reclaimer would give back."""
        cached = self.reclaimer.cached_blocks if self.reclaimer is not None else 0
        return (len(self._free) + cached) * self.block_tokens

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens from a block boundary."""
        return -(-int(tokens) // self.block_tokens)

    # --- allocation -----------------------------------------------------------------------------
    def alloc(self, n_blocks: int) -> list[int]:
        n = int(n_blocks)
        if n < 0:
            raise ValueError(f"alloc: n_blocks must be >= 0, got {n_blocks}")
        if n > len(self._free) and self.reclaimer is not None:
            self.free(self.reclaimer.reclaim(n - len(self._free)))
        if n > len(self._free):
            raise KVPoolExhausted(n, len(self._free), self.block_tokens)
        if n == 0:
            return []
        out = self._free[-n:][::-1]
        del self._free[-n:]
        self._used[out] = True
        return out

    def free(self, blocks: Iterable[int]) -> None:
        blocks = [int(b) for b in blocks]
        if not blocks:
            return
        seen: set[int] = set()
        for b in blocks:
            if b < 0 or b >= self.num_blocks:
                raise ValueError(f"free: block {b} out of range [0, {self.num_blocks})")
            if not self._used[b] or b in seen:
                raise ValueError(f"free: block {b} is not allocated (double free)")
            seen.add(b)
        self._used[blocks] = False
        # Reversed onto the stack, so that the next alloc hands them out in the order they had:
        # a session's blocks stay in ascending runs, which pair_ranges merges into few NIXL
        # descriptors (each costs ~10 us of a transfer; in descending order none merge).
        self._free.extend(reversed(blocks))

    def is_allocated(self, block: int) -> bool:
        return bool(self._used[block])

    # --- data -----------------------------------------------------------------------------------
    def _run(self, segments: Sequence[Segment]) -> tuple[int, int] | None:
        """(start, end) byte offsets when ``segments`` are one contiguous run of the buffer (a
        session's blocks mostly are: see free()), else None. Raises what check_segments raises.
        A plain loop: for the ~50 segments of a round's KV it costs less than the vectorized check
        and one numpy view a segment."""
        bt, bpt, nb = self.block_tokens, self.bytes_per_token, self.num_blocks
        start = end = -1
        contiguous = True
        for s in segments:
            b, o, t = s.block, s.offset, s.tokens
            if b < 0 or b >= nb or o < 0 or t < 0 or o + t > bt:
                self.layout.check_segments(segments)  # raises, naming the first bad one
            if not t:
                continue
            a = (b * bt + o) * bpt
            if end < 0:
                start = a
            elif a != end:
                contiguous = False
            end = a + t * bpt
        if end < 0:
            return 0, 0
        return (start, end) if contiguous else None

    def _views(self, segments: Sequence[Segment]) -> list[np.ndarray]:
        self.layout.check_segments(segments)
        views = []
        for s in segments:
            if s.tokens:
                a, b = self.layout.byte_offsets(s)
                views.append(self.buffer[a:b])
        return views

    def write(self, segments: Sequence[Segment], data: np.ndarray) -> None:
        """Copy `data` (uint8, tokens*bytes_per_token bytes in position order) into `segments`."""
        flat = np.asarray(data).reshape(-1).view(np.uint8)
        need = segments_tokens(segments) * self.bytes_per_token
        if flat.nbytes != need:
            raise ValueError(f"write: segments hold {need} bytes, data has {flat.nbytes}")
        run = self._run(segments)
        if run is not None:
            self.buffer[run[0]:run[1]] = flat
            return
        pos = 0
        for v in self._views(segments):
            v[:] = flat[pos : pos + v.nbytes]
            pos += v.nbytes

    def read(self, segments: Sequence[Segment], *, copy: bool = True) -> np.ndarray:
        """The bytes of `segments`, concatenated in order: a copy, or with ``copy=False`` a
        read-only view of the buffer when they are one contiguous run (a copy otherwise)."""
        if not copy:
            run = self._run(segments)
            if run is not None:
                v = self.buffer[run[0]:run[1]]
                v.flags.writeable = False
                return v
        views = self._views(segments)
        if not views:
            return np.empty(0, dtype=np.uint8)
        return np.concatenate(views)


class SessionKV:
    """One session's token positions -> blocks on one pool.

    Positions [0, tokens) are committed. `reserve(pool, n)` makes positions [tokens, tokens+n) writable
    (filling the partial last block first, then new blocks); `commit(k)` marks the first k reserved
    positions as holding KV. A new `reserve` replaces the previous uncommitted reservation.
    """

    def __init__(self, block_tokens: int | None = None):
        self.block_tokens = block_tokens
        self.tokens = 0
        self.reserved = 0
        self.blocks: list[int] = []

    @property
    def capacity_tokens(self) -> int:
        return len(self.blocks) * (self.block_tokens or 0)

    def _bind(self, pool: KVPool) -> None:
        if self.block_tokens is None:
            self.block_tokens = pool.block_tokens
        elif self.block_tokens != pool.block_tokens:
            raise ValueError(
                f"SessionKV has block_tokens={self.block_tokens}, pool has {pool.block_tokens}"
            )

    def reserve(self, pool: KVPool, n: int) -> list[Segment]:
        """Segments for positions [tokens, tokens+n), allocating blocks as needed (all or nothing)."""
        n = int(n)
        if n < 0:
            raise ValueError(f"reserve: n must be >= 0, got {n}")
        self._bind(pool)
        need_blocks = pool.blocks_for(self.tokens + n) - len(self.blocks)
        if need_blocks > 0:
            self.blocks.extend(pool.alloc(need_blocks))
        self.reserved = n
        return self.segments(self.tokens, n)

    def commit(self, n: int) -> None:
        n = int(n)
        if n < 0 or n > self.reserved:
            raise ValueError(f"commit: {n} tokens but {self.reserved} reserved")
        self.tokens += n
        self.reserved -= n

    def segments(self, start: int, n: int) -> list[Segment]:
        """Segments for positions [start, start+n), within committed + reserved positions."""
        start, n = int(start), int(n)
        if start < 0 or n < 0 or start + n > self.tokens + self.reserved:
            raise ValueError(
                f"segments: positions [{start}, {start + n}) outside "
                f"[0, {self.tokens + self.reserved}) (committed {self.tokens}, reserved {self.reserved})"
            )
        out: list[Segment] = []
        if n == 0:
            return out
        bt = self.block_tokens
        assert bt is not None
        pos, end = start, start + n
        while pos < end:
            i, off = divmod(pos, bt)
            k = min(bt - off, end - pos)
            out.append(Segment(self.blocks[i], off, k))
            pos += k
        return out

    def trim(self, pool: KVPool) -> None:
        """Drop the uncommitted reservation and free blocks holding no committed position."""
        self.reserved = 0
        keep = pool.blocks_for(self.tokens)
        if len(self.blocks) > keep:
            pool.free(self.blocks[keep:])
            del self.blocks[keep:]

    def truncate(self, pool: KVPool, n: int) -> None:
        """Keep only positions [0, n) (an edited conversation rewinds its history)."""
        n = int(n)
        if n < 0 or n > self.tokens:
            raise ValueError(f"truncate: {n} outside [0, {self.tokens}]")
        self.tokens = n
        self.trim(pool)

    # A pinned prefix (--prefix-sharing with the host tier: services/decode/prefix.py ``SharedKV``,
    # blocks other sessions also read) stays on the device when the rest of the KV goes to host. KV
    # of a session's own pins nothing.
    @property
    def pinned(self) -> int:
        """Leading tokens that stay on the device when the rest of the KV goes to host."""
        return 0

    def choose_pin(self) -> int:
        """As the session pauses: choose its pinned prefix; returns its tokens."""
        return 0

    def keep_pinned(self, pool: KVPool) -> None:
        """Free every block but the pinned ones (the rest of the KV went to host, or is lost)."""
        self.release(pool)

    def release(self, pool: KVPool) -> None:
        """Free every block; the session holds nothing afterwards."""
        blocks, self.blocks = self.blocks, []
        self.tokens = 0
        self.reserved = 0
        pool.free(blocks)
