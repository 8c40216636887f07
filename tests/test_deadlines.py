"""timeouts.Deadlines: the request path's bounds, with asyncio.timeout's semantics.

Time up, the task is cancelled and that cancellation leaves the block as
TimeoutError; any other cancellation stays one; a block left in time is never
cancelled afterwards; and bounds due in the same tick share one timer.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from lowproxy.timeouts import Deadlines

counts_cancellations = pytest.mark.skipif(sys.version_info < (3, 11),
                                          reason="Task.cancelling() is 3.11+")


async def test_a_bound_that_runs_out_raises_timeout_error():
    deadlines = Deadlines()
    with pytest.raises(TimeoutError):
        with deadlines.within(0.05):
            await asyncio.sleep(5)
    assert not deadlines._buckets  # its bucket went with its timer


@counts_cancellations
async def test_its_cancellation_is_taken_back():
    deadlines = Deadlines()
    task = asyncio.current_task()
    assert task is not None
    with pytest.raises(TimeoutError):
        with deadlines.within(0.05):
            await asyncio.sleep(5)
    assert task.cancelling() == 0
    await asyncio.sleep(0)  # the task goes on, not cancelled


async def test_a_block_left_in_time_is_not_cancelled_later():
    deadlines = Deadlines()
    with deadlines.within(0.05):
        await asyncio.sleep(0)
    [bucket] = deadlines._buckets.values()
    assert not bucket  # left: nothing for its timer to cancel
    await asyncio.sleep(0.3)  # past the bound: this sleep is not cut short
    assert not deadlines._buckets


async def test_no_bound_for_none():
    deadlines = Deadlines()
    with deadlines.within(None):
        await asyncio.sleep(0)
    assert not deadlines._buckets


async def test_an_error_inside_passes_through():
    deadlines = Deadlines()
    with pytest.raises(KeyError):
        with deadlines.within(5):
            raise KeyError("x")
    [bucket] = deadlines._buckets.values()
    assert not bucket


@counts_cancellations
async def test_another_cancellation_beside_the_expiry_stays_a_cancellation():
    deadlines = Deadlines()
    inside = asyncio.Event()

    async def bounded() -> None:
        with deadlines.within(5):
            inside.set()
            await asyncio.sleep(5)

    task = asyncio.ensure_future(bounded())
    await inside.wait()
    [due] = deadlines._buckets
    task.cancel()  # the client left, say, as the bound ran out
    deadlines._expire(due)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_bounds_due_in_one_tick_share_a_timer():
    deadlines = Deadlines()
    entered = []
    for _ in range(100):
        bound = deadlines.within(300)
        bound.__enter__()
        entered.append(bound)
    assert len(deadlines._buckets) == 1  # one timer for all of them (the tick: 1 s)
    [bucket] = deadlines._buckets.values()
    assert len(bucket) == 100
    for bound in entered:
        bound.__exit__(None, None, None)
    assert not bucket


@counts_cancellations
async def test_an_inner_asyncio_timeout_is_its_own():
    deadlines = Deadlines()
    with deadlines.within(5):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await asyncio.sleep(5)
        await asyncio.sleep(0)  # the outer bound is untouched and still holds
