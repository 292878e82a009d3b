"""``fine_sleep``: asyncio sleeps with sub-millisecond resolution, from one Linux timerfd per loop.

uvloop's timers have 1 ms resolution: ``asyncio.sleep`` under 0.5 ms returns at once (a loop that
"sleeps" 0.1 ms between polls spins a core) and 0.5-1.5 ms waits a whole ~1.1 ms. ``fine_sleep``
keeps its deadlines in a heap and arms a one-shot timerfd (``loop.add_reader``) for the earliest,
so a 0.2 ms sleep takes ~0.2 ms and nothing runs while nobody sleeps. Sleeps of 2 ms or more use
``asyncio.sleep``: its granularity no longer matters there. Python 3.11 has no
``os.timerfd_create`` (3.13 does), hence ctypes; without timerfd it falls back to ``asyncio.sleep``.
"""
from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import os
import time
import weakref

FINE_BELOW_S = 2e-3  # shorter sleeps go through the timerfd

_CLOCK_MONOTONIC = 1  # time.monotonic() reads the same clock on Linux
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _create = _libc.timerfd_create
    _settime = _libc.timerfd_settime
    _create.argtypes = [ctypes.c_int, ctypes.c_int]
    _settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
except (OSError, AttributeError):  # not Linux
    _create = None


class _Sleeper:
    """The deadlines of one event loop's fine sleeps and the timerfd that wakes the earliest."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        fd = _create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd = fd
        self.loop = loop
        self.heap: list[tuple[float, int, asyncio.Future]] = []
        self.armed_for = 0.0  # deadline the timerfd is set to; 0: disarmed
        self.seq = itertools.count()
        loop.add_reader(fd, self._on_ready)
        weakref.finalize(loop, os.close, fd)  # the loop owns the fd; it goes when the loop goes

    def sleep(self, delay: float) -> asyncio.Future:
        fut = self.loop.create_future()
        deadline = time.monotonic() + delay
        heapq.heappush(self.heap, (deadline, next(self.seq), fut))
        if not self.armed_for or deadline < self.armed_for:
            self._arm(deadline)
        return fut

    def _arm(self, deadline: float) -> None:
        ns = int(deadline * 1e9)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))
        if _settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")
        self.armed_for = deadline

    def _on_ready(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        self.armed_for = 0.0
        now = time.monotonic()
        heap = self.heap
        while heap and heap[0][0] <= now:
            fut = heapq.heappop(heap)[2]
            if not fut.done():  # a cancelled sleep leaves its entry behind
                fut.set_result(None)
        if heap:
            self._arm(heap[0][0])


_sleepers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sleeper]" = weakref.WeakKeyDictionary()


async def fine_sleep(delay: float) -> None:
    """``asyncio.sleep(delay)`` that keeps its time below 2 ms too (see the module docstring)."""
    if delay >= FINE_BELOW_S or _create is None:
        await asyncio.sleep(delay)
        return
    if delay <= 0:
        await asyncio.sleep(0)
        return
    loop = asyncio.get_running_loop()
    sleeper = _sleepers.get(loop)
    if sleeper is None:
        sleeper = _sleepers[loop] = _Sleeper(loop)
    await sleeper.sleep(delay)
