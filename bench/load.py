#!/usr/bin/env python3
"""Load benchmark for lowproxy, or any PD proxy that reads PD_PROXY_* variables.

    python bench/load.py                      # every scenario, one table
    python bench/load.py --json               # the same, as one JSON document
    python bench/load.py --scenario chat --proxy-cmd "python3 /path/other_proxy.py"

Three kinds of process, so none steals the others' measurements: emulated
backends (``python -m lowproxy.demo``: prefill, decode and a Mooncake bootstrap
server that answer at once), the proxy under test (a fresh process per
scenario, started with PD_PROXY_HOST/PORT/PREFILL_URL/DECODE_URL/KV_PROTOCOL/
MOONCAKE_BOOTSTRAP_PORT) and this script, whose load client is raw asyncio
streams with a minimal HTTP/1.1 reader and one keep-alive connection per
concurrency slot. Each scenario is also sent straight to the decode backend,
and the ratios say what the proxy costs.

Figures: requests/s, p50/p99 latency, the proxy's CPU time per request and per
relayed SSE chunk (utime+stime of the proxy process and its children, from
/proc), its peak RSS (VmHWM) and, for idle-streams, the RSS each open stream
costs. Linux only (/proc). No dependency beyond the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SCENARIOS = ("chat", "latency", "mooncake", "stream", "idle-streams")
TARGETS = {  # what the issue asks of lowproxy on a 2-core machine
    "chat_cpu_us": 400.0,
    "stream_cpu_us_per_chunk": 10.0,
    "idle_kb_per_stream": 30.0,
    "latency_p50_added_ms": 1.0,
}

# A ~300-byte chat body: what a short chat turn looks like on the wire.
_PROMPT = ("Summarise the following note in one sentence. The quarterly review "
           "found that latency stayed flat while traffic doubled, and the team "
           "plans to retire the old cluster next month.")


def chat_body(stream: bool) -> bytes:
    body: dict[str, Any] = {"model": "demo-model", "max_tokens": 16, "temperature": 0,
                            "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": _PROMPT}]}
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def request_bytes(port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"\r\n").encode() + body


# -- the processes under measurement (/proc)


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (a --workers parent measures its workers too)."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        parents.setdefault(ppid, []).append(int(name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, ()))
    return tree


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of pid and its descendants, in seconds."""
    user = system = 0
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        user += int(fields[11])  # utime (field 14)
        system += int(fields[12])  # stime (field 15)
    return user / CLOCK_TICKS, system / CLOCK_TICKS


def memory_kb(pid: int, key: str) -> int:
    """A /proc/<pid>/status figure (VmRSS, VmHWM) summed over the tree, in KiB."""
    total = 0
    prefix = key.encode() + b":"
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/status", "rb") as f:
                for line in f:
                    if line.startswith(prefix):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; children (proxy, backends) inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class Backends:
    """``python -m lowproxy.demo`` in its own process."""

    def __init__(self, stream_chunks: int, chunk_delay: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lowproxy.demo", "--stream-chunks", str(stream_chunks),
             "--chunk-delay", str(chunk_delay)],
            env=child_env({}), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"lowproxy.demo exited {self.proc.wait()} before it listened")
        info = json.loads(line)
        self.prefill_url: str = info["prefill"]
        self.decode_url: str = info["decode"]
        self.bootstrap_port: int = info["bootstrap_port"]
        self.decode_port = int(self.decode_url.rsplit(":", 1)[1])
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProxyProcess:
    """The proxy under test, configured through PD_PROXY_* only."""

    def __init__(self, command: list[str], backends: Backends, kv_protocol: str,
                 loop: str, extra_env: dict[str, str]) -> None:
        self.port = free_port()
        env = child_env({
            "PD_PROXY_HOST": "127.0.0.1",
            "PD_PROXY_PORT": str(self.port),
            "PD_PROXY_PREFILL_URL": backends.prefill_url,
            "PD_PROXY_DECODE_URL": backends.decode_url,
            "PD_PROXY_KV_PROTOCOL": kv_protocol,
            "PD_PROXY_MOONCAKE_BOOTSTRAP_PORT": str(backends.bootstrap_port),
            "PD_PROXY_LOOP": loop,
            "PD_PROXY_DRAIN_SECONDS": "5",
        })
        env.update(extra_env)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=self.log,
                                     cwd=ROOT)
        self.pid = self.proc.pid
        self._wait_accepting(30.0)

    def _wait_accepting(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited {self.proc.returncode}:\n{self.output()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"proxy did not accept on port {self.port}:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self) -> int:
        tree = process_tree(self.pid)[1:]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # A wrapper command (a profiler) may exit without stopping the proxy it started.
        for pid in tree:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.log.close()
        return self.proc.returncode


# -- the load client: raw asyncio streams, minimal HTTP/1.1


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


async def read_response(reader: asyncio.StreamReader, on_data: Any = None
                        ) -> tuple[int, int, bool, bool]:
    """One response: (status, SSE events seen, ended with [DONE], keep-alive).

    ``on_data(events)`` is called for each body chunk of a chunked response.
    """
    head = await reader.readuntil(b"\r\n\r\n")
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
    events = 0
    last = b""
    tail = b""
    if chunked:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                break
            data = (await reader.readexactly(size + 2))[:-2]
            # An SSE event ends with a blank line; it may straddle two chunks.
            seen = (last + data).count(b"\n\n")
            events += seen
            last = data[-1:]
            tail = (tail + data)[-16:]
            if on_data is not None:
                on_data(seen)
    elif length >= 0:
        await reader.readexactly(length)
    else:
        data = await reader.read()
        keep_alive = False
        events = data.count(b"\n\n")
        tail = data[-16:]
    return status, events, b"[DONE]" in tail, keep_alive


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


async def worker(load: Load) -> None:
    reader = writer = None
    clock = time.perf_counter
    while not load.stop:
        if writer is None:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", load.port,
                                                               limit=1 << 20)
            except OSError as exc:
                load.error(f"connect: {exc.__class__.__name__}")
                await asyncio.sleep(0.05)
                continue
        started = clock()
        try:
            async with deadline(load.timeout):
                writer.write(load.payload)
                status, events, done, keep_alive = await read_response(reader)  # type: ignore
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                BadResponse, ValueError, TimeoutError) as exc:
            load.error(exc.__class__.__name__)
            writer.transport.abort()
            reader = writer = None
            continue
        elapsed = clock() - started
        if status != 200:
            load.error(f"status {status}")
        elif load.stream and (not done or events < load.expected_events):
            load.error("stream incomplete")
        elif load.recording:
            load.latencies.append(elapsed)
            load.events += events
            if load.wanted and len(load.latencies) >= load.wanted:
                load.done.set()
        if not keep_alive:
            writer.transport.abort()
            reader = writer = None
    if writer is not None:
        writer.transport.abort()


@dataclass
class Result:
    scenario: str
    target: str  # "proxy" or "direct"
    concurrency: int
    requests: int = 0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu_us_per_request: float | None = None
    chunks: int = 0
    cpu_us_per_chunk: float | None = None
    cpu_sys_share: float | None = None  # of that CPU, the kernel's (stime) part
    peak_rss_kb: int | None = None
    rss_before_kb: int | None = None
    rss_open_kb: int | None = None
    kb_per_stream: float | None = None
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


def percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


async def drive(scenario: str, target: str, port: int, measured_pid: int | None,
                concurrency: int, args: argparse.Namespace, stream: bool) -> Result:
    """Closed-loop load: warm up, then record for --duration seconds or --requests."""
    path = "/v1/chat/completions"
    load = Load(port=port, payload=request_bytes(port, path, chat_body(stream)), stream=stream,
                timeout=args.timeout, expected_events=args.stream_chunks if stream else 0,
                wanted=args.requests or 0)
    workers = [asyncio.ensure_future(worker(load)) for _ in range(concurrency)]
    try:
        await asyncio.sleep(args.warmup)
        cpu_before = cpu_times(measured_pid) if measured_pid else (0.0, 0.0)
        started = time.perf_counter()
        load.recording = True
        if load.wanted:
            try:
                await asyncio.wait_for(load.done.wait(), args.timeout + load.wanted)
            except asyncio.TimeoutError:
                load.error("run did not finish")
        else:
            await asyncio.sleep(args.duration)
        load.recording = False
        elapsed = time.perf_counter() - started
        cpu_after = cpu_times(measured_pid) if measured_pid else (0.0, 0.0)
    finally:
        load.stop = True
        _, pending = await asyncio.wait(workers, timeout=args.timeout)
        for task in pending:
            task.cancel()
    ordered = sorted(load.latencies)
    result = Result(scenario, target, concurrency, requests=len(ordered),
                    rps=len(ordered) / elapsed if elapsed else 0.0,
                    p50_ms=percentile(ordered, 0.50), p99_ms=percentile(ordered, 0.99),
                    chunks=load.events, errors=load.errors, error_kinds=load.error_kinds)
    if measured_pid and ordered:
        user, system = (after - before for after, before in zip(cpu_after, cpu_before))
        cpu_us = (user + system) * 1e6
        result.cpu_us_per_request = cpu_us / len(ordered)
        result.cpu_sys_share = system / (user + system) if user + system else None
        if stream and load.events:
            result.cpu_us_per_chunk = cpu_us / load.events
        result.peak_rss_kb = memory_kb(measured_pid, "VmHWM")
    return result


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


async def idle_streams(target: str, port: int, measured_pid: int, args: argparse.Namespace
                       ) -> Result:
    """N slow streams open at once: the memory each costs, and CPU per trickled chunk."""
    n = args.idle_streams
    # Warm the server first (imports, pools, caches): the baseline is its steady state.
    warm = Load(port=port, payload=request_bytes(port, "/v1/chat/completions",
                                                 chat_body(False)),
                stream=False, timeout=args.timeout, recording=True, wanted=20)
    tasks = [asyncio.ensure_future(worker(warm)) for _ in range(4)]
    try:
        await asyncio.wait_for(warm.done.wait(), args.timeout)
    except asyncio.TimeoutError:
        warm.error("warm-up did not finish")
    warm.stop = True
    await asyncio.wait(tasks, timeout=args.timeout)
    await asyncio.sleep(0.5)
    rss_before = memory_kb(measured_pid, "VmRSS")
    count = StreamCount(n)
    gate = asyncio.Semaphore(256)
    payload = request_bytes(port, "/v1/chat/completions", chat_body(True))
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
        cpu_before = cpu_times(measured_pid)
        count.chunks = 0
        await asyncio.sleep(args.idle_hold)
        cpu_after = cpu_times(measured_pid)
        chunks = count.chunks
        peak = memory_kb(measured_pid, "VmHWM")
        still_open = count.open - count.failed_after_open
    finally:
        count.closing = True
        for task in streams:
            task.cancel()
        await asyncio.wait(streams, timeout=args.timeout)
    errors = warm.errors + count.failed
    kinds = dict(warm.error_kinds)
    kinds.update(count.error_kinds)
    result = Result(scenario="idle-streams", target=target, concurrency=n,
                    requests=count.open, rps=count.open / open_seconds if open_seconds else 0.0,
                    errors=errors, error_kinds=kinds, rss_before_kb=rss_before,
                    rss_open_kb=rss_open, peak_rss_kb=peak, chunks=chunks)
    if still_open:
        result.kb_per_stream = (rss_open - rss_before) / still_open
    if chunks and target == "proxy":
        user, system = (after - before for after, before in zip(cpu_after, cpu_before))
        result.cpu_us_per_chunk = (user + system) * 1e6 / chunks
        result.cpu_sys_share = system / (user + system) if user + system else None
    return result


# -- running scenarios


def proxy_command(args: argparse.Namespace) -> list[str]:
    if args.proxy_cmd:
        return shlex.split(args.proxy_cmd)
    return [sys.executable, "-m", "lowproxy"]


def extra_env(args: argparse.Namespace) -> dict[str, str]:
    env = {}
    for item in args.proxy_env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--proxy-env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env


def run_fast(scenario: str, backends: Backends, args: argparse.Namespace) -> list[Result]:
    """chat, latency, mooncake, stream: the proxy, then the same load to decode."""
    stream = scenario == "stream"
    concurrency = 1 if scenario == "latency" else args.concurrency
    kv_protocol = "mooncake" if scenario == "mooncake" else "relay"
    proxy = ProxyProcess(proxy_command(args), backends, kv_protocol, args.loop, extra_env(args))
    try:
        through = asyncio.run(drive(scenario, "proxy", proxy.port, proxy.pid, concurrency,
                                    args, stream))
    finally:
        proxy.stop()
    direct = asyncio.run(drive(scenario, "direct", backends.decode_port, None, concurrency,
                               args, stream))
    return [through, direct]


def run_idle(args: argparse.Namespace) -> list[Result]:
    """Slow streams: a separate, slow decode; the proxy's RSS; then decode's own."""
    chunks = int((args.timeout + args.idle_streams / 100 + args.idle_settle + args.idle_hold)
                 / args.idle_chunk_delay) + 60
    results = []
    backends = Backends(chunks, args.idle_chunk_delay)
    try:
        proxy = ProxyProcess(proxy_command(args), backends, "relay", args.loop, extra_env(args))
        try:
            results.append(asyncio.run(idle_streams("proxy", proxy.port, proxy.pid, args)))
        finally:
            proxy.stop()
    finally:
        backends.stop()
    # Direct, on fresh backends: the decode's own memory per stream, for comparison.
    backends = Backends(chunks, args.idle_chunk_delay)
    try:
        results.append(asyncio.run(idle_streams("direct", backends.decode_port, backends.pid,
                                                args)))
    finally:
        backends.stop()
    return results


def ratios(results: list[Result]) -> list[dict[str, Any]]:
    found = []
    by_key = {(r.scenario, r.target): r for r in results}
    for scenario in SCENARIOS:
        through, direct = by_key.get((scenario, "proxy")), by_key.get((scenario, "direct"))
        if not through or not direct:
            continue
        entry: dict[str, Any] = {"scenario": scenario}
        if scenario == "idle-streams":
            if through.kb_per_stream is not None and direct.kb_per_stream:
                entry["kb_per_stream_ratio"] = through.kb_per_stream / direct.kb_per_stream
        else:
            if direct.rps:
                entry["rps_ratio"] = through.rps / direct.rps
            if through.p50_ms is not None and direct.p50_ms:
                entry["p50_ratio"] = through.p50_ms / direct.p50_ms
                entry["p50_added_ms"] = through.p50_ms - direct.p50_ms
            if through.p99_ms is not None and direct.p99_ms:
                entry["p99_ratio"] = through.p99_ms / direct.p99_ms
        found.append(entry)
    return found


def targets(results: list[Result], args: argparse.Namespace) -> list[dict[str, Any]]:
    by_key = {(r.scenario, r.target): r for r in results}
    checks = []

    def check(name: str, value: float | None, limit: float, ok: bool) -> None:
        checks.append({"target": name, "value": value, "limit": limit,
                       "pass": bool(ok and value is not None)})

    chat = by_key.get(("chat", "proxy"))
    if chat:
        value = chat.cpu_us_per_request
        check(f"chat c={chat.concurrency}: proxy CPU us/request <= {TARGETS['chat_cpu_us']:g}, "
              f"no errors", value, TARGETS["chat_cpu_us"],
              value is not None and value <= TARGETS["chat_cpu_us"] and chat.errors == 0)
    stream = by_key.get(("stream", "proxy"))
    if stream:
        value = stream.cpu_us_per_chunk
        limit = TARGETS["stream_cpu_us_per_chunk"]
        check(f"stream: proxy CPU us/chunk <= {limit:g}", value, limit,
              value is not None and value <= limit and stream.errors == 0)
    idle = by_key.get(("idle-streams", "proxy"))
    if idle:
        value = idle.kb_per_stream
        limit = TARGETS["idle_kb_per_stream"]
        check(f"idle-streams {args.idle_streams}: proxy KB/open stream <= {limit:g}, "
              f"no errors", value, limit,
              value is not None and value <= limit and idle.errors == 0)
    through, direct = by_key.get(("latency", "proxy")), by_key.get(("latency", "direct"))
    if through and direct:
        value = None
        if through.p50_ms is not None and direct.p50_ms is not None:
            value = through.p50_ms - direct.p50_ms
        limit = TARGETS["latency_p50_added_ms"]
        check(f"latency c=1: p50 added over direct <= {limit:g} ms", value, limit,
              value is not None and value <= limit and through.errors == 0)
    return checks


def derived(results: list[Result], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Figures computed from two runs of the same invocation (not targets)."""
    by_key = {(r.scenario, r.target): r for r in results}
    notes = []
    chat, stream = by_key.get(("chat", "proxy")), by_key.get(("stream", "proxy"))
    if (chat and stream and chat.cpu_us_per_request is not None
            and stream.cpu_us_per_request is not None and args.stream_chunks):
        # A streamed request pays the same fixed cost as a chat request (client
        # exchange, prefill leg, decode leg); what is left is the cost of relaying.
        notes.append({"figure": "stream: proxy CPU us per extra chunk, (stream - chat) / chunks",
                      "value": (stream.cpu_us_per_request - chat.cpu_us_per_request)
                      / args.stream_chunks})
    return notes


# -- output

COLUMNS = (("scenario", 12), ("target", 6), ("conc", 5), ("requests", 8), ("req/s", 8),
           ("p50 ms", 7), ("p99 ms", 7), ("cpu us/req", 10), ("cpu us/chunk", 12),
           ("peak RSS MB", 11), ("KB/stream", 9), ("errors", 6))


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(results: list[Result], found_ratios: list[dict[str, Any]],
          checks: list[dict[str, Any]], notes: list[dict[str, Any]],
          args: argparse.Namespace) -> str:
    lines = [f"lowproxy bench: proxy {' '.join(proxy_command(args))!r}, loop {args.loop}, "
             f"{os.cpu_count()} cpus, " + (f"{args.requests} requests" if args.requests else
                                           f"{args.duration:g}s") + " per run"]
    lines.append("  ".join(name.rjust(width) for name, width in COLUMNS))
    for r in results:
        row = (r.scenario, r.target, r.concurrency, r.requests, _fmt(r.rps, 0),
               _fmt(r.p50_ms, 2), _fmt(r.p99_ms, 2), _fmt(r.cpu_us_per_request, 0),
               _fmt(r.cpu_us_per_chunk, 2),
               _fmt(r.peak_rss_kb / 1024 if r.peak_rss_kb is not None else None, 1),
               _fmt(r.kb_per_stream, 1), r.errors)
        lines.append("  ".join(str(value).rjust(width) for value, (_, width) in zip(row, COLUMNS)))
        if r.error_kinds:
            lines.append(" " * 14 + "errors: " + ", ".join(f"{k} x{v}"
                                                          for k, v in r.error_kinds.items()))
    lines.append("")
    lines.append("proxy vs direct to decode:")
    for entry in found_ratios:
        parts = []
        if "rps_ratio" in entry:
            parts.append(f"req/s x{entry['rps_ratio']:.2f}")
        if "p50_ratio" in entry:
            parts.append(f"p50 x{entry['p50_ratio']:.2f} ({entry['p50_added_ms']:+.2f} ms)")
        if "p99_ratio" in entry:
            parts.append(f"p99 x{entry['p99_ratio']:.2f}")
        if "kb_per_stream_ratio" in entry:
            parts.append(f"KB/stream x{entry['kb_per_stream_ratio']:.2f}")
        lines.append(f"  {entry['scenario']:<12} " + ", ".join(parts))
    lines.append("")
    lines.append("targets:")
    for entry in checks:
        value = "-" if entry["value"] is None else f"{entry['value']:.2f}"
        lines.append(f"  [{'PASS' if entry['pass'] else 'FAIL'}] {entry['target']}: {value}")
    if notes:
        lines.append("")
        lines.append("derived:")
        for note in notes:
            lines.append(f"  {note['figure']}: {note['value']:.2f}")
    lines.append("")
    lines.append("cpu: the proxy process's utime+stime over the measured window; direct rows "
                 "have no proxy. idle-streams: requests = streams open, req/s = streams opened "
                 "per second, KB/stream = (RSS with all open - RSS before) / streams (direct: "
                 "the decode backend's own), cpu us/chunk = while they trickle.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/load.py", description="Load benchmark for lowproxy or any PD proxy "
        "that reads PD_PROXY_* variables. Linux only (/proc).")
    parser.add_argument("--scenario", default="all",
                        help=f"comma-separated, of {', '.join(SCENARIOS)}; or all (default)")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="connections in flight for chat, mooncake and stream (default 32; "
                        "latency always runs at 1)")
    parser.add_argument("--duration", type=float, default=5.0,
                        help="seconds recorded per run, after the warm-up (default 5)")
    parser.add_argument("--requests", type=int, default=0,
                        help="record this many requests per run instead of --duration")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="seconds of load before recording starts (default 1)")
    parser.add_argument("--proxy-cmd", default="",
                        help="command starting the proxy under test; it must honour "
                        "PD_PROXY_HOST/PORT/PREFILL_URL/DECODE_URL/KV_PROTOCOL/"
                        "MOONCAKE_BOOTSTRAP_PORT (default: this Python -m lowproxy)")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the proxy (repeatable)")
    parser.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop", "auto"),
                        help="PD_PROXY_LOOP for the proxy (default asyncio)")
    parser.add_argument("--stream-chunks", type=int, default=64,
                        help="SSE chunks per streamed response (default 64)")
    parser.add_argument("--idle-streams", type=int, default=2000,
                        help="slow streams held open at once (default 2000)")
    parser.add_argument("--idle-chunk-delay", type=float, default=1.0,
                        help="seconds between chunks of a slow stream (default 1)")
    parser.add_argument("--idle-settle", type=float, default=1.0,
                        help="seconds after all slow streams opened before RSS is read")
    parser.add_argument("--idle-hold", type=float, default=3.0,
                        help="seconds the slow streams trickle while CPU is measured")
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request timeout")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of the table")
    parser.add_argument("--json-file", default="", metavar="PATH",
                        help="also write the JSON document to PATH")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a target fails or any request failed")
    args = parser.parse_args(argv)
    names = SCENARIOS if args.scenario == "all" else tuple(
        s.strip() for s in args.scenario.split(",") if s.strip())
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    args.scenarios = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.exists("/proc/self/stat"):
        print("bench/load.py needs Linux /proc", file=sys.stderr)
        return 2
    limit = raise_fd_limit()
    if "idle-streams" in args.scenarios and limit < args.idle_streams + 256:
        print(f"warning: RLIMIT_NOFILE {limit} is low for {args.idle_streams} streams",
              file=sys.stderr)
    results: list[Result] = []
    fast = [s for s in args.scenarios if s != "idle-streams"]
    if fast:
        backends = Backends(args.stream_chunks, 0.0)
        try:
            for scenario in fast:
                if not args.json:
                    print(f"running {scenario} ...", file=sys.stderr, flush=True)
                results.extend(run_fast(scenario, backends, args))
        finally:
            backends.stop()
    if "idle-streams" in args.scenarios:
        if not args.json:
            print("running idle-streams ...", file=sys.stderr, flush=True)
        results.extend(run_idle(args))
    found_ratios = ratios(results)
    checks = targets(results, args)
    notes = derived(results, args)
    document = json.dumps({"proxy_cmd": proxy_command(args), "loop": args.loop,
                           "cpus": os.cpu_count(), "duration": args.duration,
                           "requests": args.requests, "results": [asdict(r) for r in results],
                           "ratios": found_ratios, "targets": checks, "derived": notes},
                          indent=2)
    if args.json_file:
        with open(args.json_file, "w") as f:
            f.write(document + "\n")
    if args.json:
        print(document)
    else:
        print(table(results, found_ratios, checks, notes, args))
    if args.check and (any(r.errors for r in results) or not all(c["pass"] for c in checks)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
