#!/usr/bin/env python3
"""Soak lowproxy: sustained load with injected faults, then check that nothing leaked.

    python bench/soak.py                     # 10 minutes, relay handshake
    python bench/soak.py --duration 60 --kv-protocol mooncake --concurrency 32

The proxy runs as its own process (``python -m lowproxy`` with PD_PROXY_*
variables); this script runs the emulated backends and the load clients. A
share of requests (``--fault-rate``) asks for a fault: the backends read it
from the request body (a ``soak_fault`` field the proxy forwards untouched)
and misbehave on that request only; client faults are played by the client.

  decode_dies      decode sends two events, then drops the connection
  decode_closes    decode closes without answering
  decode_500       decode answers 500
  decode_slow      decode waits up to a second before answering
  prefill_500      prefill answers 500 (the proxy recomputes on decode)
  prefill_hang     prefill never answers (bounded by the prefill timeout)
  vanish_body      the client hangs up in the middle of its request body
  vanish_stream    the client hangs up in the middle of a streamed answer
  garbage          the client sends bytes that are not HTTP
  slow_reader      the client reads a long stream slowly

Every request ends in one of: the answer expected for its fault ("served" when
that is a 200, "failed as expected" otherwise), "unexpected" (an answer, but
not the expected one), "lost" (no answer and no error: the connection closed
without a status line, or nothing came within --request-timeout) or "vanished"
(the client left on purpose). At the end the load stops, the proxy settles
(idle upstream connections expire after PD_PROXY_UPSTREAM_IDLE_SECONDS=2) and
its open descriptors, RSS and /metrics gauges are compared with the baseline.
Progress is printed every --report-every seconds, and a JSON summary last.
Exit status 0 when nothing was lost or unexpected and descriptors came back to
the baseline; 1 otherwise. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import h11

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lowproxy.demo import DemoBackend, KvRegistry  # noqa: E402
from lowproxy.answers import json_body  # noqa: E402
from lowproxy.messages import AbortResponse  # noqa: E402

CHAT = b"/v1/chat/completions"
FAULTS = ("decode_dies", "decode_closes", "decode_500", "decode_slow", "prefill_500",
          "prefill_hang", "vanish_body", "vanish_stream", "garbage", "slow_reader")
# What a client must see, by fault: (status, complete). None: the client left.
EXPECTED = {None: (200, True), "decode_dies": (200, False), "decode_closes": (502, True),
            "decode_500": (500, True), "decode_slow": (200, True), "prefill_500": (200, True),
            "prefill_hang": (200, True), "garbage": (400, True), "slow_reader": (200, True),
            "vanish_body": None, "vanish_stream": None}


# -- backends that misbehave when a request asks them to


class FaultyBackend(DemoBackend):
    """A demo backend that plays the fault named in a request's ``soak_fault`` field."""

    async def handle(self, request: Any, responder: Any) -> None:
        fault = None
        if request.method == b"POST" and b"soak_fault" in request.body:
            try:
                fault = json.loads(request.body).get("soak_fault")
            except ValueError:
                pass
        prefix = f"{self.role}_"
        if not fault or not fault.startswith(prefix):
            await super().handle(request, responder)
            return
        responder.watch_client()  # a hang-up cancels us, as vLLM aborts
        kind = fault[len(prefix):]
        if kind == "dies":
            await responder.start(200, [(b"content-type", b"text/event-stream")])
            for index in range(2):
                await responder.write(b"data: " + json_body({"index": index}) + b"\n\n")
            raise AbortResponse()
        if kind == "closes":
            responder.drop()
        elif kind == "500":
            await responder.send_json(500, {"error": {"message": "injected", "code": 500}})
        elif kind == "hang":
            await asyncio.Event().wait()
        elif kind == "slow":
            await asyncio.sleep(random.uniform(0.1, 1.0))
            await super().handle(request, responder)
        else:
            await super().handle(request, responder)


async def start_backends() -> tuple[FaultyBackend, FaultyBackend]:
    registry = KvRegistry()
    prefill = FaultyBackend("prefill", registry=registry, record=False)
    decode = FaultyBackend("decode", registry=registry, record=False)
    await prefill.start("127.0.0.1", 0, bootstrap_port=0)
    await decode.start("127.0.0.1", 0, bootstrap_port=None)
    return prefill, decode


# -- the proxy process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_proxy(args: argparse.Namespace, prefill: DemoBackend, decode: DemoBackend
                ) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    env.update({
        "PYTHONPATH": ROOT, "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(port),
        "PD_PROXY_PREFILL_URL": f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}",
        "PD_PROXY_DECODE_URL": decode.url, "PD_PROXY_KV_PROTOCOL": args.kv_protocol,
        "PD_PROXY_MOONCAKE_BOOTSTRAP_PORT": str(prefill.bootstrap_port),
        "PD_PROXY_PREFILL_TIMEOUT_SECONDS": "1", "PD_PROXY_UPSTREAM_IDLE_SECONDS": "2",
        "PD_PROXY_LOG_LEVEL": "warning", "PD_PROXY_LOOP": args.loop,
    })
    log = open(args.proxy_log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "lowproxy"], env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, port


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


GAUGES = ("lowproxy_client_connections", "lowproxy_requests_in_flight",
          "lowproxy_upstream_connections", "process_open_fds", "lowproxy_asyncio_tasks")


async def scrape(port: int) -> dict[str, float]:
    """Gauges from GET /metrics (summed over labels); lowproxy_upstream_connections: open."""
    status, body, _ = await one_request(port, b"GET", b"/metrics", None, timeout=10)
    found: dict[str, float] = {}
    if status != 200:
        return found
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name in GAUGES:
            if name == "lowproxy_upstream_connections" and 'state="open"' not in name_labels:
                continue
            found[name] = found.get(name, 0.0) + float(value)
    found["lowproxy_client_connections"] = found.get("lowproxy_client_connections", 1) - 1
    return found  # (less this scrape's own connection)


async def proxy_state(proc: subprocess.Popen, port: int) -> dict[str, Any]:
    state: dict[str, Any] = {"fds": open_fds(proc.pid), "rss_kib": rss_kib(proc.pid)}
    state.update(await scrape(port))
    return state


# -- a minimal HTTP/1.1 client


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> "Connection":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.close()

    async def request(self, method: bytes, target: bytes, body: bytes | None,
                      slow: bool = False) -> tuple[int, bytes, bool]:
        """(status, body, complete); status 0: no answer at all."""
        headers = [(b"host", b"soak")]
        if body is not None:
            headers += [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]
        conn = self.h11
        data = conn.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            data += conn.send(h11.Data(data=body))
        data += conn.send(h11.EndOfMessage())
        self.writer.write(data)
        await self.writer.drain()
        status, parts = 0, []
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return status, b"".join(parts), False
            if event is h11.NEED_DATA:
                try:
                    chunk = await self.reader.read(65536 if not slow else 1024)
                except ConnectionError:
                    chunk = b""
                if slow:
                    await asyncio.sleep(0.002)
                conn.receive_data(chunk)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return status, b"".join(parts), True
            elif isinstance(event, h11.ConnectionClosed):
                return status, b"".join(parts), False

    def reusable(self) -> bool:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False


async def one_request(port: int, method: bytes, target: bytes, body: bytes | None,
                      timeout: float) -> tuple[int, bytes, bool]:
    conn = await Connection.open(port)
    try:
        return await asyncio.wait_for(conn.request(method, target, body), timeout)
    finally:
        conn.close()


def chat_body(fault: str | None, stream: bool, tokens: int) -> bytes:
    body: dict[str, Any] = {"model": "demo-model", "max_tokens": tokens, "stream": stream,
                            "messages": [{"role": "user", "content": "soak"}]}
    if fault:
        body["soak_fault"] = fault
    return json.dumps(body).encode()


# -- the load


class Soak:
    def __init__(self, args: argparse.Namespace, port: int) -> None:
        self.args = args
        self.port = port
        self.outcomes: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.stop_at = 0.0

    def pick_fault(self) -> str | None:
        return random.choice(FAULTS) if random.random() < self.args.fault_rate else None

    async def worker(self) -> None:
        conn: Connection | None = None
        while time.monotonic() < self.stop_at:
            fault = self.pick_fault()
            if fault:
                self.faults[fault] += 1
            try:
                if fault in ("vanish_body", "vanish_stream", "garbage"):
                    await self.client_fault(fault)
                    continue
                if conn is None:
                    conn = await Connection.open(self.port)
                stream = fault in ("decode_dies", "slow_reader") or random.random() < 0.5
                tokens = 200 if fault == "slow_reader" else 8
                answer = await asyncio.wait_for(
                    conn.request(b"POST", CHAT, chat_body(fault, stream, tokens),
                                 slow=fault == "slow_reader"), self.args.request_timeout)
                self.judge(fault, *answer)
                if not conn.reusable():
                    conn.close()
                    conn = None
            except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
                self.lost(fault, f"{type(exc).__name__}: {exc}")
                if conn is not None:
                    conn.close()
                    conn = None
        if conn is not None:
            conn.close()

    def judge(self, fault: str | None, status: int, body: bytes, complete: bool) -> None:
        if status == 0:
            self.lost(fault, "connection closed without an answer")
            return
        if (status, complete) == EXPECTED[fault]:
            self.outcomes["served" if status == 200 else "failed as expected"] += 1
        else:
            self.outcomes["unexpected"] += 1
            if len(self.unexpected) < 20:
                self.unexpected.append(f"{fault or 'none'}: {status} complete={complete} "
                                       f"{body[:120]!r}")

    def lost(self, fault: str | None, why: str) -> None:
        self.outcomes["lost"] += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(f"LOST {fault or 'none'}: {why}")

    async def client_fault(self, fault: str) -> None:
        if fault == "garbage":
            self.judge(fault, *await self.garbage())
            return
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            body = chat_body(None, True, 50)
            head = (b"POST %s HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % (CHAT, len(body)))
            if fault == "vanish_body":
                writer.write(head + body[: len(body) // 2])
                await writer.drain()
            else:
                writer.write(head + body)
                await writer.drain()
                await asyncio.wait_for(reader.read(1024), self.args.request_timeout)
        finally:
            writer.transport.abort()
        self.outcomes["vanished"] += 1

    async def garbage(self) -> tuple[int, bytes, bool]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(b"\x16\x03\x01\x00\xa5" + os.urandom(random.randint(1, 300)) + b"\r\n\r\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(), self.args.request_timeout)
        finally:
            writer.close()
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(raw)
        conn.receive_data(b"")
        status, complete = 0, False
        try:
            while True:
                event = conn.next_event()
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    complete = True
                    break
                elif isinstance(event, h11.ConnectionClosed) or event is h11.NEED_DATA:
                    break
        except h11.RemoteProtocolError:
            pass
        return status, raw, complete


def say(text: str) -> None:
    print(text, flush=True)


async def settle(proc: subprocess.Popen, port: int, target_fds: int | None, seconds: float
                 ) -> dict[str, Any]:
    """Wait until no client or upstream connection is open (and fds are at target)."""
    deadline = time.monotonic() + seconds
    while True:
        state = await proxy_state(proc, port)
        quiet = (state.get("lowproxy_client_connections", 0) <= 0
                 and state.get("lowproxy_requests_in_flight", 0) <= 0
                 and state.get("lowproxy_upstream_connections", 0) <= 0
                 and (target_fds is None or state["fds"] <= target_fds))
        if quiet or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    prefill, decode = await start_backends()
    proc, port = start_proxy(args, prefill, decode)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                status, _, _ = await one_request(port, b"GET", b"/readyz", None, timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                say(f"proxy did not start (exit {proc.poll()}); see {args.proxy_log}")
                return 1
            await asyncio.sleep(0.1)
        # Warm up, then let the pools empty: the baseline is a quiet proxy.
        for stream in (False, True):
            await one_request(port, b"POST", CHAT, chat_body(None, stream, 4), timeout=10)
        before = await settle(proc, port, None, 10)
        say(f"soak: proxy pid {proc.pid} port {port} ({args.kv_protocol}), "
            f"{args.duration:g}s, concurrency {args.concurrency}, fault rate {args.fault_rate}")
        say(f"before: {json.dumps(before)}")

        soak = Soak(args, port)
        started = time.monotonic()
        soak.stop_at = started + args.duration
        workers = [asyncio.create_task(soak.worker()) for _ in range(args.concurrency)]
        while not all(w.done() for w in workers):
            await asyncio.wait(workers, timeout=args.report_every)
            if proc.poll() is not None:
                say(f"proxy exited with {proc.returncode} during the soak")
                break
            elapsed = time.monotonic() - started
            done = sum(soak.outcomes.values())
            state = await proxy_state(proc, port)
            say(f"[{elapsed:6.0f}s] requests {done} ({done / max(elapsed, 1e-9):.0f}/s) "
                f"faults {sum(soak.faults.values())} {dict(soak.outcomes)} "
                f"fds {state['fds']} rss {state['rss_kib']} KiB")
        for worker in workers:
            if worker.done() and worker.exception() is not None:
                say(f"worker failed: {worker.exception()!r}")
        elapsed = time.monotonic() - started
        alive = proc.poll() is None
        after = await settle(proc, port, before["fds"], args.settle) if alive else {}
        say(f"after:  {json.dumps(after)}")
        for line in soak.unexpected:
            say(f"  {line}")
        summary = {
            "duration_s": round(elapsed, 1), "kv_protocol": args.kv_protocol,
            "requests": sum(soak.outcomes.values()),
            "served": soak.outcomes["served"],
            "failed_as_expected": soak.outcomes["failed as expected"],
            "vanished": soak.outcomes["vanished"],
            "lost": soak.outcomes["lost"], "unexpected": soak.outcomes["unexpected"],
            "faults_injected": sum(soak.faults.values()), "faults": dict(soak.faults),
            "proxy_alive": alive, "proxy_before": before, "proxy_after": after,
            "fds_leaked": (after.get("fds", 0) - before["fds"]) if alive else None,
        }
        ok = (alive and summary["lost"] == 0 and summary["unexpected"] == 0
              and after.get("fds", 10**9) <= before["fds"]
              and not any(w.done() and w.exception() for w in workers))
        summary["ok"] = ok
        say(json.dumps({"soak": summary}))
        return 0 if ok else 1
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        await prefill.close()
        await decode.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--fault-rate", type=float, default=0.3,
                        help="share of requests that ask for a fault")
    parser.add_argument("--kv-protocol", choices=("relay", "mooncake", "sglang"),
                        default="relay")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--report-every", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=30.0,
                        help="seconds the proxy gets to close everything after the load")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="the proxy's event loop (PD_PROXY_LOOP)")
    parser.add_argument("--proxy-log", help="where the proxy's log goes",
                        default=os.path.join("/tmp", f"soak-proxy-{os.getpid()}.log"))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
