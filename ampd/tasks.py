"""An owner for background tasks: what a service starts and does not await at once.

``asyncio`` keeps only a weak reference to a task, so a task whose result is dropped may be
collected while it runs, and one still running at shutdown is cut off wherever it stands. A
``BackgroundTasks`` keeps a reference to each task it spawned until the task ends, and its owner
cancels (or lets finish) and awaits the rest when it shuts down."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator

__all__ = ["BackgroundTasks"]


class BackgroundTasks:
    """The tasks one owner started: ``spawn`` starts one, ``close`` cancels and awaits those still
    running (``cancel=False``: awaits them to their end). A finished task is dropped at once."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._tasks))

    async def wait(self) -> None:
        """Until every task running now has ended (their errors are theirs: not raised here)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self, cancel: bool = True) -> None:
        """Cancels (unless ``cancel`` is False) every task still running and awaits them all."""
        while self._tasks:  # a task may spawn another while it ends
            tasks = list(self._tasks)
            if cancel:
                for t in tasks:
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
