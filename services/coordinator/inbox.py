"""A session's inbox on the coordinator: everything that happens to it, in order, for its one loop."""
from __future__ import annotations

import asyncio
from collections import deque

from ampd.events import merge_tokens

__all__ = ["Inbox"]


class Inbox:
    """A queue with one consumer: ``put_nowait`` and ``get`` as asyncio.Queue's (unbounded), plus
    ``peek`` at the next message without taking it, which asyncio.Queue does not offer (the
    session merges the token events queued right behind one into it)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self):
        """The next message (IndexError when there is none)."""
        return self._items.popleft()

    def peek(self):
        """The next message, left in place; None when there is none."""
        return self._items[0] if self._items else None

    def merge_tokens(self, ev, gen: int) -> None:
        """Takes the token events of the same round and binding ``gen`` queued right behind the
        decode event ``ev`` into it: one event to the client instead of several (the decode
        worker's Attach does the same)."""
        items = self._items
        while items and (nxt := items[0])[0] == "event" and nxt[1] == gen and merge_tokens(ev, nxt[2]):
            items.popleft()
