"""Bounds on waiting: ``async with deadline(seconds)`` raises TimeoutError when time is up.

asyncio.wait_for is not used for bounds on the request path: before Python
3.12 it can swallow a cancellation that lands as the awaited operation
completes (CPython gh-86296), and a decode leg that missed its cancellation
would wait for KV that never comes, its connection open for ever.
asyncio.timeout (3.11+) counts cancellations and has no such race.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any


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
