"""ampd.tasks.BackgroundTasks: a task is kept while it runs, and close() cancels and awaits the rest."""
import asyncio
import gc

from ampd.tasks import BackgroundTasks


async def test_a_task_is_kept_until_it_ends_then_dropped():
    tasks = BackgroundTasks()
    gate = asyncio.Event()
    done = []

    async def work():
        await gate.wait()
        done.append(1)

    tasks.spawn(work(), name="w")
    gc.collect()  # only the owner's reference keeps it
    assert len(tasks) == 1 and [t.get_name() for t in tasks] == ["w"]
    gate.set()
    await tasks.wait()
    assert done == [1] and len(tasks) == 0


async def test_close_cancels_and_awaits_what_still_runs():
    tasks = BackgroundTasks()
    ended = []

    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("cleaned up")

    t = tasks.spawn(forever())
    await asyncio.sleep(0)
    await tasks.close()
    assert t.cancelled() and ended == ["cleaned up"] and len(tasks) == 0


async def test_close_without_cancel_lets_them_finish_and_keeps_their_errors_to_them():
    tasks = BackgroundTasks()
    out = []

    async def short():
        await asyncio.sleep(0.01)
        out.append("done")

    async def fails():
        raise RuntimeError("boom")

    tasks.spawn(short())
    bad = tasks.spawn(fails())
    await tasks.close(cancel=False)
    assert out == ["done"] and isinstance(bad.exception(), RuntimeError)
