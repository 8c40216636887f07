"""Long streams for bench/load.py: idle-streams (memory per open stream) and trickle
(CPU per relayed event when every event is its own read)."""

from __future__ import annotations

import argparse
import asyncio
import time

from load_client import (
    CHAT_PATH,
    EXCHANGE_ERRORS,
    BadResponse,
    Connection,
    Load,
    Result,
    chat_body,
    cpu_spent,
    cpu_start,
    finish,
    read_response,
    request_bytes,
    worker,
)
from load_procs import memory_kb


class StreamCount:
    """What the slow streams of one idle-streams run saw."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.open = 0
        self.failed = 0
        self.failed_after_open = 0
        self.chunks = 0
        self.closing = False
        self.error_kinds: dict[str, int] = {}
        self.settled = asyncio.Event()  # every stream is open or has failed

    def opened(self) -> None:
        self.open += 1
        self._check()

    def fail(self, kind: str, after_open: bool = False) -> None:
        if self.closing:
            return  # our own hang-up
        self.failed += 1
        self.failed_after_open += after_open
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        self._check()

    def _check(self) -> None:
        if self.open + self.failed >= self.wanted:
            self.settled.set()


async def hold_stream(port: int, payload: bytes, count: StreamCount,
                      gate: asyncio.Semaphore) -> None:
    """One slow stream: open it, count it as open at its first chunk, keep reading."""
    writer = None
    seen = 0

    def on_data(events: int) -> None:
        nonlocal seen
        if not seen:
            count.opened()
        seen += 1
        count.chunks += events

    try:
        async with gate:  # a bounded connect storm
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            writer.write(payload)
        status, _, _, _ = await read_response(reader, on_data=on_data)
        count.fail(f"status {status}" if status != 200 else "ended early", bool(seen))
    except asyncio.CancelledError:
        pass
    except (OSError, asyncio.IncompleteReadError, BadResponse, ValueError) as exc:
        count.fail(exc.__class__.__name__, bool(seen))
    finally:
        if writer is not None:
            writer.transport.abort()


async def warm_up(port: int, timeout: float, requests: int = 20) -> Load:
    """A few chat requests first (imports, pools, caches): measure the steady state."""
    warm = Load(port=port, payload=request_bytes(port, CHAT_PATH, chat_body(False)),
                stream=False, timeout=timeout, recording=True, wanted=requests)
    tasks = [asyncio.ensure_future(worker(warm)) for _ in range(4)]
    try:
        await asyncio.wait_for(warm.done.wait(), timeout)
    except asyncio.TimeoutError:
        warm.error("warm-up did not finish")
    warm.stop = True
    await asyncio.wait(tasks, timeout=timeout)
    return warm


async def idle_streams(target: str, port: int, measured_pid: int, args: argparse.Namespace
                       ) -> Result:
    """N slow streams open at once: the memory each costs, and CPU per trickled chunk."""
    n = args.idle_streams
    warm = await warm_up(port, args.timeout)
    await asyncio.sleep(0.5)
    rss_before = memory_kb(measured_pid, "VmRSS")
    count = StreamCount(n)
    gate = asyncio.Semaphore(256)
    payload = request_bytes(port, CHAT_PATH, chat_body(True))
    started = time.perf_counter()
    streams = [asyncio.ensure_future(hold_stream(port, payload, count, gate))
               for _ in range(n)]
    try:
        try:
            await asyncio.wait_for(count.settled.wait(), args.timeout + n / 100)
        except asyncio.TimeoutError:
            count.fail("not all streams opened in time")
        open_seconds = time.perf_counter() - started
        await asyncio.sleep(args.idle_settle)
        rss_open = memory_kb(measured_pid, "VmRSS")
        # Every open stream trickles a chunk per --idle-chunk-delay: CPU per chunk.
        cpu_before = cpu_start(measured_pid)
        count.chunks = 0
        await asyncio.sleep(args.idle_hold)
        user, system = cpu_spent(measured_pid, cpu_before)
        chunks = count.chunks
        peak = memory_kb(measured_pid, "VmHWM")
        still_open = count.open - count.failed_after_open
    finally:
        count.closing = True
        for task in streams:
            task.cancel()
        await asyncio.wait(streams, timeout=args.timeout)
    result = Result(scenario="idle-streams", target=target, concurrency=n,
                    requests=count.open, rps=count.open / open_seconds if open_seconds else 0.0,
                    errors=warm.errors + count.failed,
                    error_kinds={**warm.error_kinds, **count.error_kinds},
                    rss_before_kb=rss_before, rss_open_kb=rss_open, peak_rss_kb=peak,
                    chunks=chunks)
    if still_open:
        result.kb_per_stream = (rss_open - rss_before) / still_open
    if chunks and user + system:
        result.cpu_us_per_chunk = (user + system) * 1e6 / chunks
        result.cpu_sys_share = system / (user + system)
    return result


async def _trickle_round(slots: list[Connection], load: Load, interval: float) -> None:
    """Every slot sends one stream; starts spread over one event interval, as streams
    that began at different times would be, so events do not all land in one tick."""

    async def one(index: int, slot: Connection) -> None:
        await asyncio.sleep(interval * index / len(slots))
        started = time.perf_counter()
        seen = 0

        def on_data(events: int) -> None:
            nonlocal seen
            seen += events

        try:
            status, events, done = await slot.exchange(load.payload, load.timeout, on_data)
        except EXCHANGE_ERRORS as exc:
            load.error(exc.__class__.__name__)
            return
        if load.check(status, events, done) and load.recording:
            load.latencies.append(time.perf_counter() - started)
            load.events += seen

    await asyncio.gather(*(one(i, slot) for i, slot in enumerate(slots)))


async def trickle(target: str, port: int, measured_pid: int | None, args: argparse.Namespace
                  ) -> Result:
    """N concurrent streams whose decode sends one event per --trickle-interval: each
    event reaches the proxy as its own read, as real token streams do.

    One unmeasured round opens every connection (client side and the proxy's upstream
    pool), then --trickle-rounds rounds are measured whole: every request and every
    event of the window is counted, so CPU per event has no partial streams in it.
    """
    n = args.trickle_streams
    warm = await warm_up(port, args.timeout)
    load = Load(port=port, payload=request_bytes(port, CHAT_PATH, chat_body(True)),
                stream=True, timeout=args.timeout, expected_events=args.trickle_events,
                errors=warm.errors, error_kinds=dict(warm.error_kinds))
    slots = [Connection(port) for _ in range(n)]
    try:
        await _trickle_round(slots, load, args.trickle_interval)
        cpu_before = cpu_start(measured_pid)
        started = time.perf_counter()
        load.recording = True
        for _ in range(args.trickle_rounds):
            await _trickle_round(slots, load, args.trickle_interval)
        elapsed = time.perf_counter() - started
        cpu = cpu_spent(measured_pid, cpu_before)
    finally:
        for slot in slots:
            slot.close()
    result = Result("trickle", target, n, chunks=load.events, errors=load.errors,
                    error_kinds=load.error_kinds)
    return finish(result, load.latencies, elapsed, measured_pid, cpu)
