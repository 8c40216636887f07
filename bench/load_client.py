"""The load client of bench/load.py: raw asyncio streams and a minimal HTTP/1.1 reader.

One keep-alive connection per concurrency slot, closed-loop (a slot sends its
next request when the previous answer ended), so the figures are the proxy's
and not a client library's.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import common
from load_procs import cpu_delta, cpu_sample, memory_kb

CHAT_PATH = "/v1/chat/completions"

# A ~300-byte chat body: what a short chat turn looks like on the wire.
_PROMPT = ("Summarise the following note in one sentence. The quarterly review "
           "found that latency stayed flat while traffic doubled, and the team "
           "plans to retire the old cluster next month.")


def chat_body(stream: bool) -> bytes:
    return common.chat_body([{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": _PROMPT}], 16, stream, temperature=0)


def prefill_leg_body() -> bytes:
    """What a relay proxy sends the prefill backend for chat_body(False): one token, not
    streamed, KV kept for a remote decode (the shape of lowproxy's prefill leg)."""
    body = json.loads(chat_body(False))
    body.update({"max_tokens": 1, "stream": False, "ignore_eos": True,
                 "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    return json.dumps(body, separators=(",", ":")).encode()


def request_bytes(port: int, path: str, body: bytes, extra: bytes = b"") -> bytes:
    """One request; ``extra``: more header lines, each ending in CRLF."""
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            ).encode() + extra + b"\r\n" + body


class BadResponse(Exception):
    pass


if sys.version_info >= (3, 11):
    def deadline(seconds: float) -> Any:
        return asyncio.timeout(seconds)
else:  # pragma: no cover - 3.10
    class deadline:  # type: ignore[no-redef]
        """asyncio.timeout for 3.10: cancel the current task at the deadline."""

        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        async def __aenter__(self) -> None:
            task = asyncio.current_task()
            self.fired = False

            def fire() -> None:
                self.fired = True
                task.cancel()  # type: ignore[union-attr]
            self.handle = asyncio.get_running_loop().call_later(self.seconds, fire)

        async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
            self.handle.cancel()
            if self.fired and exc_type is asyncio.CancelledError:
                raise TimeoutError()
            return False


# What a failed exchange may raise; the slot reconnects and counts an error.
EXCHANGE_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                   BadResponse, ValueError, TimeoutError)


def _parse_head(head: bytes) -> tuple[int, int, bool, bool]:
    """(status, content-length or -1, chunked, keep-alive) of a response head."""
    if not head.startswith(b"HTTP/1."):
        raise BadResponse("not an HTTP response")
    status = int(head[9:12])
    length = -1
    chunked = False
    keep_alive = head[7:8] == b"1"
    for line in head.lower().split(b"\r\n")[1:]:
        if line.startswith(b"content-length:"):
            length = int(line[15:])
        elif line.startswith(b"transfer-encoding:"):
            chunked = b"chunked" in line
        elif line.startswith(b"connection:"):
            keep_alive = b"close" not in line
    return status, length, chunked, keep_alive


async def _read_chunked(reader: asyncio.StreamReader, on_data: Any) -> tuple[int, bytes]:
    """A chunked body: (SSE events seen, its last bytes)."""
    events = 0
    last = tail = b""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return events, tail
        data = (await reader.readexactly(size + 2))[:-2]
        # An SSE event ends with a blank line; it may straddle two chunks.
        seen = (last + data).count(b"\n\n")
        events += seen
        last = data[-1:]
        tail = (tail + data)[-16:]
        if on_data is not None:
            on_data(seen)


async def read_response(reader: asyncio.StreamReader, on_data: Any = None
                        ) -> tuple[int, int, bool, bool]:
    """One response: (status, SSE events seen, ended with [DONE], keep-alive).

    ``on_data(events)`` is called for each body chunk of a chunked response.
    """
    status, length, chunked, keep_alive = _parse_head(await reader.readuntil(b"\r\n\r\n"))
    events = 0
    tail = b""
    if chunked:
        events, tail = await _read_chunked(reader, on_data)
    elif length >= 0:
        await reader.readexactly(length)
    else:
        data = await reader.read()
        keep_alive = False
        events = data.count(b"\n\n")
        tail = data[-16:]
    return status, events, b"[DONE]" in tail, keep_alive


class Connection:
    """One client slot's keep-alive connection, opened on first use and after a failure."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, payload: bytes, timeout: float, on_data: Any = None
                       ) -> tuple[int, int, bool]:
        """Send one request, read its answer: (status, SSE events, ended with [DONE])."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                "127.0.0.1", self.port, limit=1 << 20)
        try:
            async with deadline(timeout):
                self.writer.write(payload)
                status, events, done, keep_alive = await read_response(
                    self.reader, on_data)  # type: ignore[arg-type]
        except BaseException:
            self.close()
            raise
        if not keep_alive:
            self.close()
        return status, events, done

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        self.reader = self.writer = None


@dataclass
class Load:
    """Shared by one run's workers: what to send, what was seen."""

    port: int
    payload: bytes
    stream: bool
    timeout: float
    expected_events: int = 0
    recording: bool = False
    stop: bool = False
    wanted: int = 0  # count mode: stop recording after this many
    latencies: list[float] = field(default_factory=list)
    events: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def check(self, status: int, events: int, done: bool) -> bool:
        """Whether an answer is a whole success; counts the error when not."""
        if status != 200:
            self.error(f"status {status}")
        elif self.stream and (not done or events < self.expected_events):
            self.error("stream incomplete")
        else:
            return True
        return False


async def worker(load: Load) -> None:
    connection = Connection(load.port)
    clock = time.perf_counter
    while not load.stop:
        connecting = connection.writer is None
        started = clock()
        try:
            status, events, done = await connection.exchange(load.payload, load.timeout)
        except EXCHANGE_ERRORS as exc:
            if connecting and isinstance(exc, OSError):
                load.error(f"connect: {exc.__class__.__name__}")
                await asyncio.sleep(0.05)
            else:
                load.error(exc.__class__.__name__)
            continue
        elapsed = clock() - started
        if load.check(status, events, done) and load.recording:
            load.latencies.append(elapsed)
            load.events += events
            if load.wanted and len(load.latencies) >= load.wanted:
                load.done.set()
    connection.close()


@dataclass
class Result:
    scenario: str
    target: str  # "proxy", "direct" (to decode) or "prefill" (to prefill, a prefill leg)
    concurrency: int
    loop: str = ""
    run: int = 1
    requests: int = 0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    # proxy rows: the proxy's CPU; direct and prefill rows: the backends process's
    cpu_us_per_request: float | None = None
    chunks: int = 0
    cpu_us_per_chunk: float | None = None
    cpu_us_per_chunk_net: float | None = None  # trickle: net of chat's per-request cost
    cpu_sys_share: float | None = None  # of that CPU, the kernel's (stime) part
    # proxy rows of closed-loop runs: what the other processes spent per request meanwhile
    backend_cpu_us_per_request: float | None = None
    client_cpu_us_per_request: float | None = None
    peak_rss_kb: int | None = None
    rss_before_kb: int | None = None
    rss_open_kb: int | None = None
    kb_per_stream: float | None = None
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    # the latency distribution for --plot: the 0th to 100th percentile, in ms
    latency_cdf_ms: list[float] = field(default_factory=list)


def percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def finish(result: Result, latencies: list[float], elapsed: float, measured_pid: int | None,
           cpu: tuple[float, float]) -> Result:
    """Fill in the figures of a run from its latencies and CPU (user, system) seconds."""
    ordered = sorted(latencies)
    result.requests = len(ordered)
    result.rps = len(ordered) / elapsed if elapsed else 0.0
    result.p50_ms, result.p99_ms = percentile(ordered, 0.50), percentile(ordered, 0.99)
    if ordered:
        result.latency_cdf_ms = [round(ordered[min(len(ordered) - 1, len(ordered) * q // 100)]
                                       * 1000.0, 4) for q in range(101)]
    if measured_pid and ordered:
        user, system = cpu
        cpu_us = (user + system) * 1e6
        result.cpu_us_per_request = cpu_us / len(ordered)
        result.cpu_sys_share = system / (user + system) if user + system else None
        if result.chunks:
            result.cpu_us_per_chunk = cpu_us / result.chunks
        result.peak_rss_kb = memory_kb(measured_pid, "VmHWM")
    return result


Sample = tuple[float, float, float | None]
NO_SAMPLE: Sample = (0.0, 0.0, 0.0)


def cpu_start(pid: int | None) -> Sample:
    return cpu_sample(pid) if pid else NO_SAMPLE


def cpu_spent(pid: int | None, before: Sample) -> tuple[float, float]:
    """(user, system) seconds pid's tree spent since ``before``; zeros for no pid."""
    return cpu_delta(before, cpu_sample(pid)) if pid else (0.0, 0.0)


def client_cpu() -> float:
    """This script's own CPU seconds (not its children: they are the backends and proxy)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def drive(scenario: str, target: str, port: int, measured_pid: int | None,
                concurrency: int, settings: Any, stream: bool,
                body: bytes | None = None, backend_pid: int | None = None) -> Result:
    """Closed-loop load: warm up, then record for --duration seconds or --requests.

    ``backend_pid``: also measure the backends and this client over the same window,
    so the CPU all processes spend per request (what a core count allows) is known.
    """
    payload = request_bytes(port, CHAT_PATH, body if body is not None else chat_body(stream),
                            getattr(settings, "client_header", b""))
    load = Load(port=port, payload=payload, stream=stream, timeout=settings.timeout,
                expected_events=settings.stream_chunks if stream else 0,
                wanted=settings.requests or 0)
    workers = [asyncio.ensure_future(worker(load)) for _ in range(concurrency)]
    try:
        await asyncio.sleep(settings.warmup)
        cpu_before, backend_before = cpu_start(measured_pid), cpu_start(backend_pid)
        client_before, started = client_cpu(), time.perf_counter()
        load.recording = True
        if load.wanted:
            try:
                await asyncio.wait_for(load.done.wait(), settings.timeout + load.wanted)
            except asyncio.TimeoutError:
                load.error("run did not finish")
        else:
            await asyncio.sleep(settings.duration)
        load.recording = False
        elapsed = time.perf_counter() - started
        cpu, backend = cpu_spent(measured_pid, cpu_before), cpu_spent(backend_pid, backend_before)
        client = client_cpu() - client_before
    finally:
        load.stop = True
        _, pending = await asyncio.wait(workers, timeout=settings.timeout)
        for task in pending:
            task.cancel()
    result = Result(scenario, target, concurrency, chunks=load.events, errors=load.errors,
                    error_kinds=load.error_kinds)
    if backend_pid and load.latencies:
        result.backend_cpu_us_per_request = sum(backend) * 1e6 / len(load.latencies)
        result.client_cpu_us_per_request = client * 1e6 / len(load.latencies)
    return finish(result, load.latencies, elapsed, measured_pid, cpu)
