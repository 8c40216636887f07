"""Bounds on waiting: ``async with deadline(seconds)`` raises TimeoutError when time is up.

asyncio.wait_for is not used for bounds on the request path: before Python
3.12 it can swallow a cancellation that lands as the awaited operation
completes (CPython gh-86296), and a decode leg that missed its cancellation
would wait for KV that never comes, its connection open for ever.
asyncio.timeout (3.11+) counts cancellations and has no such race.

``Deadlines`` is the request path's cheaper form of the same bound (see there).
"""

from __future__ import annotations

import asyncio
import math
import sys
from typing import Any

_CANCELLED = asyncio.CancelledError


class _NoDeadline:
    """No bound (the default for decode: a generation may stream for many minutes)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_DEADLINE = _NoDeadline()


if sys.version_info >= (3, 11):
    def deadline(seconds: float | None) -> Any:
        return _NO_DEADLINE if seconds is None else asyncio.timeout(seconds)
else:  # pragma: no cover - Python 3.10
    class deadline:
        """asyncio.timeout for 3.10: cancel the current task when time is up."""

        def __init__(self, seconds: float | None) -> None:
            self.seconds = seconds
            self.handle: asyncio.TimerHandle | None = None
            self.expired = False

        async def __aenter__(self) -> deadline:
            if self.seconds is not None:
                task = asyncio.current_task()
                loop = asyncio.get_running_loop()

                def expire() -> None:
                    self.expired = True
                    task.cancel()  # type: ignore[union-attr]

                self.handle = loop.call_later(self.seconds, expire)
            return self

        async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
            if self.handle is not None:
                self.handle.cancel()
            if self.expired and exc_type is asyncio.CancelledError:
                raise TimeoutError()
            return False


class Deadlines:
    """``with deadlines.within(seconds):``, the bound ``deadline`` sets, for the request path.

    asyncio.timeout arms a loop timer of its own per use and cancels it at
    exit: on uvloop about 27k instructions, more than a task, for a bound (the
    prefill leg's 300 s) that a request ends in milliseconds. Here the bounds
    due within one tick share a timer (a bucket): a bound costs a set insertion
    and removal, and is met up to a tick late, never early. The tick is 1/64
    of the bound, at most one second: 300 s bounds share one timer a second,
    a 0.5 s bound is late by 8 ms at most.

    The same semantics as asyncio.timeout otherwise: time up, the task is
    cancelled; that cancellation, and only that one, leaves the block as
    TimeoutError (3.11+ counts cancellations; 3.10 as ``deadline`` does there).
    A plain ``with``: it never suspends, entering or leaving. One object per
    event loop owns the buckets (the Dispatcher's).
    """

    __slots__ = ("loop", "_buckets")

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._buckets: dict[float, set[_Bound]] = {}

    def within(self, seconds: float | None) -> Any:
        return _NO_BOUND if seconds is None else _Bound(self, seconds)

    def _bucket(self, loop: asyncio.AbstractEventLoop, seconds: float) -> set[_Bound]:
        tick = min(seconds / 64.0, 1.0) or 1e-3
        due = math.ceil((loop.time() + seconds) / tick) * tick
        bucket = self._buckets.get(due)
        if bucket is None:
            bucket = self._buckets[due] = set()
            loop.call_at(due, self._expire, due)
        return bucket

    def _expire(self, due: float) -> None:
        for bound in self._buckets.pop(due, ()):
            bound.expired = True
            bound.task.cancel()


class _Bound:
    __slots__ = ("_owner", "_seconds", "task", "expired", "_cancelling", "_bucket")

    def __init__(self, owner: Deadlines, seconds: float) -> None:
        self._owner = owner
        self._seconds = seconds
        self.expired = False

    def __enter__(self) -> None:
        owner = self._owner
        loop = owner.loop
        if loop is None:
            loop = owner.loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a bound is set inside a task")
        self.task = task
        if sys.version_info >= (3, 11):
            self._cancelling = task.cancelling()
        self._bucket = bucket = owner._bucket(loop, self._seconds)
        bucket.add(self)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._bucket.discard(self)
        if self.expired:
            if sys.version_info >= (3, 11):
                if self.task.uncancel() <= self._cancelling and exc_type is _CANCELLED:
                    raise TimeoutError from exc
            elif exc_type is _CANCELLED:  # pragma: no cover - Python 3.10
                raise TimeoutError from exc


class _NoBound:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_BOUND = _NoBound()
