"""The prefill leg of a concurrent handshake (Mooncake, SGLang), watched from the request's task.

Both legs go out at once. The prefill leg runs in a task of its own, since it
must outlive a client that leaves (aborting a vLLM prefill mid-transfer can
leak KV blocks). Decode's response head is awaited in the request's own task:
a second task per request would cost its creation, its scheduling and its
cleanup on every request, and is needed only in the rare case that prefill
fails while decode's head is still awaited. Then decode would wait for KV that
never comes (480 s, or for ever before vLLM 0.30), so the watch interrupts the
wait by cancelling the request's task, as a decode task of its own would have
been cancelled; ``ours()`` tells that cancellation from any other (the client
leaving, a timeout), which goes on as it came.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from .failures import PrefillResult


def _failed(task: asyncio.Task[PrefillResult]) -> bool:
    """No KV for decode: the leg failed, or (Mooncake) it stopped and its KV was freed."""
    if task.cancelled() or task.exception() is not None:
        return True
    result = task.result()
    return not result.ok or result.outcome == "stopped"


class PrefillWatch:
    """One request's prefill task, seen from the task that awaits decode's head.

    ``opening`` is True while that task awaits decode's head: a prefill leg
    that ends without success in that time cancels it (once). Afterwards,
    ``result()`` waits for the prefill leg without ever cancelling it.
    """

    __slots__ = ("task", "opening", "interrupted", "_owner", "_waiter")

    def __init__(self, task: asyncio.Task[PrefillResult], owner: asyncio.Task[Any]) -> None:
        self.task = task
        self.opening = True
        self.interrupted = False  # the prefill leg failed and cancelled the decode wait
        self._owner = owner
        self._waiter: asyncio.Future[None] | None = None
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[PrefillResult]) -> None:
        if self.opening:
            if _failed(task):
                self.interrupted = True
                self._owner.cancel()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def ours(self) -> bool:
        """Called on a CancelledError out of the decode wait: whether it is the watch's
        own, and only that (then it is taken back, and the caller goes on)."""
        self.opening = False
        if not self.interrupted:
            return False
        if sys.version_info >= (3, 11):
            # Another cancellation counted beside ours (the client left, a
            # timeout expired): that one goes on.
            return self._owner.uncancel() == 0
        return True  # pragma: no cover - Python 3.10 counts no cancellations

    async def result(self, loop: asyncio.AbstractEventLoop) -> PrefillResult:
        """The prefill leg's result, once it has one; a cancelled wait leaves it running."""
        if not self.task.done():
            self._waiter = loop.create_future()
            await self._waiter
        return self.task.result()
