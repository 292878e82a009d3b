"""NotifListener: a KV transport's notifications handed to a callback on the event loop, promptly.

Transport-agnostic: it polls ``KVTransport.poll_notifs`` (ampd.kv.protocol), so the NIXL transport
and the loopback one share it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from .finetimer import fine_sleep

if TYPE_CHECKING:
    from .protocol import KVTransport

__all__ = ["NotifListener", "POLL_FIRST_S", "POLL_MIN_S", "POLL_MAX_S", "POLL_RATIO"]

log = logging.getLogger(__name__)

# NotifListener polling: the first poll POLL_FIRST_S after a wait begins, then every POLL_MIN_S;
# once a wait has lasted longer, every 1/POLL_RATIO of the time waited so far, at most every
# POLL_MAX_S. Each poll is a wake-up of the event loop (~30 us of CPU here, measured), so a 100 ms
# wait polls ~115 times (~3.5 % of a core; 1/100 capped at 1 ms polled ~260 times) and a
# notification is seen at most 1/POLL_RATIO of the wait late. No notification can come sooner
# than POLL_FIRST_S after a decode worker asks for a prefill (the coordinator routes it, the
# prefill worker reads and writes KV: three hops of ~0.3 ms or more), and a prefill routed to the
# decode worker itself comes back as LocalPrefill within about that time, with no poll at all. A
# remote round's notification comes ~1.5-3 ms after the wait begins, where polls are POLL_MIN_S
# apart: between two processes a notification was seen ~190 us after its WRITE was posted with
# polls every 200 us and ~110 us with polls every 50 us (NIXL's progress thread, which takes it
# in, passes every PROGRESS_DELAY_US: the rest).
POLL_FIRST_S = 1e-3
POLL_MIN_S = 100e-6
POLL_MAX_S = 2e-3
POLL_RATIO = 25


class NotifListener:
    """Hands a transport's notifications (NIXL's) to ``callback`` on the event loop, promptly.

    NIXL offers no file descriptor to wait on, so someone must poll. This used to be
    ``asyncio.sleep(0.0005)`` between polls, which under uvloop (1 ms timers) returns at once: it
    spun a core whenever a prefill was outstanding, and polled 100 times a second otherwise. This
    task polls with ``fine_sleep`` only while ``pending()`` says a notification is expected
    (``arm()`` wakes it when a wait begins) and sleeps on an event otherwise. Notifications that
    arrive while it sleeps wait in the transport until the next poll. Its task is its own: the
    listener's owner calls ``stop()``, which cancels and awaits it.
    """

    def __init__(self, transport: "KVTransport", callback: Callable[[str, bytes], None],
                 pending: Callable[[], bool]) -> None:
        self._transport = transport
        self._callback = callback
        self._pending = pending
        self._armed = asyncio.Event()
        self.polls = 0
        self._task = asyncio.create_task(self._run(), name=f"kv-notifs-{transport.name}")

    def arm(self) -> None:
        """A notification is now expected: poll until ``pending()`` turns false."""
        self._armed.set()

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._armed.wait()
            since = time.monotonic()
            await fine_sleep(POLL_FIRST_S)
            while True:
                self._armed.clear()
                got = self._transport.poll_notifs()
                self.polls += 1
                for peer, msg in got:
                    try:
                        self._callback(peer, msg)
                    except Exception:  # one bad notification must not stop the others
                        log.exception("notification callback failed (peer %s)", peer)
                now = time.monotonic()
                if got:
                    since = now
                if not self._pending() and not self._armed.is_set():
                    break
                await fine_sleep(min(POLL_MAX_S, max(POLL_MIN_S, (now - since) / POLL_RATIO)))
