"""The soak's clients: which faults exist, what each must look like to a client,
and the load loop that asks for them and judges every answer."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import common
import h11

CHAT = b"/v1/chat/completions"
# Played by the backends (decode_* through the gate or decode, prefill_* by prefill)
# or by the client itself (vanish_*, garbage, slow_reader).
FAULTS = ("decode_dies", "decode_closes", "decode_500", "decode_slow", "prefill_500",
          "prefill_hang", "vanish_body", "vanish_stream", "garbage", "slow_reader",
          "decode_hostile_usage", "decode_stray_same", "decode_stray_later", "decode_hangs_up",
          "decode_cl_chunked")
# The kinds issue 10 added: bytes after a complete response (in its last write, or
# later on the idle connection), a hang-up after reading a POST, and Content-Length
# beside Transfer-Encoding: chunked.
WIRE_FAULTS = FAULTS[-4:]
# What a client may see, by fault: {(status, complete)}. None: the client left.
EXPECTED: dict[str | None, set[tuple[int, bool]] | None] = {
    None: {(200, True)}, "decode_dies": {(200, False)}, "decode_closes": {(502, True)},
    "decode_500": {(500, True)}, "decode_slow": {(200, True)}, "prefill_500": {(200, True)},
    "prefill_hang": {(200, True)}, "garbage": {(400, True)}, "slow_reader": {(200, True)},
    "vanish_body": None, "vanish_stream": None,
    # Relayed as decode sent it: the usage bytes unchanged (checked in wrong_answer).
    "decode_hostile_usage": {(200, True)},
    "decode_stray_same": {(200, True)}, "decode_stray_later": {(200, True)},
    # No retry of a POST decode may have received (RFC 9110 9.2.2): the client gets 502.
    "decode_hangs_up": {(502, True)},
    # Framed by Transfer-Encoding (RFC 9112 6.3), or refused before the answer starts.
    "decode_cl_chunked": {(200, True), (502, True)},
}
# Under sglang a failed prefill is a 502: an SGLang decode cannot recompute (issue 19).
SGLANG_EXPECTED: dict[str | None, set[tuple[int, bool]] | None] = {
    "prefill_500": {(502, True)}, "prefill_hang": {(502, True)},
}
DETAILS_KEPT = 20
# decode_hostile_usage: usage objects the proxy's cached-token rewrite cannot
# understand (issue 19), as raw JSON text (1e400 must stay text: Python reads it
# as infinity). Each must reach the client byte for byte.
HOSTILE_USAGE = (
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":"cached"}',
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":7}',
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":[["cached_tokens",1]]}',
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":true}',
    '{"prompt_tokens":"5","completion_tokens":2}',
    '{"prompt_tokens":1e400,"completion_tokens":2}',
    '{"prompt_tokens":5,"completion_tokens":2,"total_tokens":1e400}',
    '{"prompt_tokens":5,"completion_tokens":2,"total_tokens":NaN}',
)


def hostile_usage(soak_id: str | None) -> str:
    """The hostile usage decode sends for ``soak_id`` (the client knows it too)."""
    number = int(soak_id[1:]) if soak_id and soak_id[1:].isdigit() else 0
    return HOSTILE_USAGE[number % len(HOSTILE_USAGE)]


@dataclass
class Reply:
    status: int  # 0: no answer at all
    body: bytes
    complete: bool
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)


class Connection:
    """A minimal HTTP/1.1 client connection (keep-alive, one request at a time)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.close()

    async def request(self, method: bytes, target: bytes, body: bytes | None,
                      slow: bool = False) -> Reply:
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
        return await self._reply(slow)

    async def _reply(self, slow: bool) -> Reply:
        reply, parts = Reply(0, b"", False), []
        conn = self.h11
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                break
            if event is h11.NEED_DATA:
                try:
                    chunk = await self.reader.read(65536 if not slow else 1024)
                except ConnectionError:
                    chunk = b""
                if slow:
                    await asyncio.sleep(0.002)
                conn.receive_data(chunk)
            elif isinstance(event, h11.Response):
                reply.status, reply.headers = event.status_code, list(event.headers)
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                reply.complete = True
                break
            elif isinstance(event, h11.ConnectionClosed):
                break
        reply.body = b"".join(parts)
        return reply

    def reusable(self) -> bool:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False


async def one_request(port: int, method: bytes, target: bytes, body: bytes | None,
                      timeout: float) -> Reply:
    conn = await Connection.open(port)
    try:
        return await asyncio.wait_for(conn.request(method, target, body), timeout)
    finally:
        conn.close()


def chat_body(fault: str | None, stream: bool, tokens: int, soak_id: str | None = None) -> bytes:
    fields: dict[str, Any] = {}
    if fault:
        fields["soak_fault"] = fault
    if soak_id:
        fields["soak_id"] = soak_id  # forwarded untouched; the gate echoes it as x-soak-id
    return common.chat_body([{"role": "user", "content": "soak"}], tokens, stream, **fields)


def wrong_answer(soak_id: str, stream: bool, reply: Reply,
                 fault: str | None = None) -> str | None:
    """Why ``reply`` is not this request's answer, or None when it is."""
    echoed = reply.header(b"x-soak-id")
    if echoed is not None and echoed != soak_id.encode():
        return f"another request's answer (x-soak-id {echoed!r})"
    if reply.status == 200 and echoed is None:
        return "a 200 that decode did not send for this request (no x-soak-id)"
    if reply.header(b"content-length") is not None and \
            reply.header(b"transfer-encoding") is not None:
        return "content-length beside transfer-encoding"
    if reply.status != 200 or not reply.complete:
        return None
    if fault == "decode_hostile_usage" and \
            b'"usage":' + hostile_usage(soak_id).encode() not in reply.body:
        return "decode's usage was not relayed as decode sent it"
    if stream:
        return None if reply.body.endswith(b"data: [DONE]\n\n") else "stream without [DONE]"
    try:
        parsed = json.loads(reply.body)
    except ValueError:
        return "a body that is not the JSON decode sent"
    return None if isinstance(parsed, dict) and parsed.get("choices") else "no choices"


class Soak:
    def __init__(self, args: argparse.Namespace, port: int) -> None:
        self.args = args
        self.port = port
        self.faults_wanted: tuple[str, ...] = tuple(args.faults)
        self.outcomes: Counter[str] = Counter()
        self.healthz: Counter[str] = Counter()  # /healthz probes during the load: ok, failed
        self.faults: Counter[str] = Counter()
        self.details: list[str] = []
        self.bad: Counter[tuple[str, str]] = Counter()  # (fault, outcome) not as expected
        self.stop_at = 0.0
        self._ids = itertools.count()
        # x-soak-ids of strays that crossed the proxy's next request (the gate's
        # FaultGate.crossed): received, they are HTTP/1.1's ambiguity, not a fault.
        self.crossed: set[str] = set()
        self.pending: set[str] = set()  # FaultGate.pending: strays not yet judged
        self.expected = dict(EXPECTED)
        if getattr(args, "kv_protocol", None) == "sglang":
            self.expected.update(SGLANG_EXPECTED)

    def pick_fault(self) -> str | None:
        if self.faults_wanted and random.random() < self.args.fault_rate:
            return random.choice(self.faults_wanted)
        return None

    def bad_by_fault(self) -> dict[str, dict[str, int]]:
        """Outcomes that were not the expected ones, by the fault the request asked for
        (a stray answer lands on a later request, so mostly on "none")."""
        table: dict[str, dict[str, int]] = {}
        for (fault, outcome), count in sorted(self.bad.items()):
            table.setdefault(fault, {})[outcome] = count
        return table

    def note(self, line: str) -> None:
        if len(self.details) < DETAILS_KEPT:
            self.details.append(line)

    async def worker(self) -> None:
        conn: Connection | None = None
        while time.monotonic() < self.stop_at:
            fault = self.pick_fault()
            if fault:
                self.faults[fault] += 1
            soak_id = f"s{next(self._ids)}"
            try:
                if fault in ("vanish_body", "vanish_stream", "garbage"):
                    await self.client_fault(fault, soak_id)
                    continue
                if conn is None:
                    conn = await Connection.open(self.port)
                stream = fault in ("decode_dies", "slow_reader") or random.random() < 0.5
                tokens = 200 if fault == "slow_reader" else 8
                reply = await asyncio.wait_for(
                    conn.request(b"POST", CHAT, chat_body(fault, stream, tokens, soak_id),
                                 slow=fault == "slow_reader"), self.args.request_timeout)
                await self.verdict_on(reply)
                self.judge(fault, reply, soak_id, stream)
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

    async def verdict_on(self, reply: Reply) -> None:
        """A stray can reach a client before the gate has told whether it crossed a
        request (it waits CROSSING_GRACE to know): wait for that verdict."""
        echoed = reply.header(b"x-soak-id")
        name = echoed.decode("ascii", "replace") if echoed is not None else ""
        for _ in range(200):
            if name not in self.pending:
                return
            await asyncio.sleep(0.01)

    def judge(self, fault: str | None, reply: Reply, soak_id: str | None = None,
              stream: bool = False) -> None:
        if reply.status == 0:
            self.lost(fault, "connection closed without an answer")
            return
        wrong = wrong_answer(soak_id, stream, reply, fault) if soak_id else None
        expected = self.expected[fault] or set()
        echoed = reply.header(b"x-soak-id")
        if wrong and echoed is not None and echoed.decode("ascii", "replace") in self.crossed:
            self.outcomes["crossed a stray"] += 1  # no HTTP/1.1 client could tell
            if self.outcomes["crossed a stray"] <= 3:  # leave room for real failures
                self.note(f"CROSSED {fault or 'none'} {soak_id}: {echoed!r}")
        elif wrong:
            self.outcomes["answered wrong"] += 1
            self.bad[(fault or "none", "answered wrong")] += 1
            self.note(f"WRONG {fault or 'none'} {soak_id}: {wrong}: {reply.status} "
                      f"{reply.body[:80]!r}")
        elif (reply.status, reply.complete) in expected:
            self.outcomes["served" if reply.status == 200 else "failed as expected"] += 1
        else:
            self.outcomes["unexpected"] += 1
            self.bad[(fault or "none", "unexpected")] += 1
            self.note(f"{fault or 'none'}: {reply.status} complete={reply.complete} "
                      f"{reply.body[:120]!r}")

    def lost(self, fault: str | None, why: str) -> None:
        self.outcomes["lost"] += 1
        self.bad[(fault or "none", "lost")] += 1
        self.note(f"LOST {fault or 'none'}: {why}")

    async def client_fault(self, fault: str, soak_id: str) -> None:
        if fault == "garbage":
            self.judge(fault, await self.garbage())
            return
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            body = chat_body(None, True, 50, soak_id)
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

    async def garbage(self) -> Reply:
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
        reply = Reply(0, raw, False)
        try:
            while True:
                event = conn.next_event()
                if isinstance(event, h11.Response):
                    reply.status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    reply.complete = True
                    break
                elif isinstance(event, h11.ConnectionClosed) or event is h11.NEED_DATA:
                    break
        except h11.RemoteProtocolError:
            pass
        return reply
