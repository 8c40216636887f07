"""The soak's backends: emulated vLLM prefill and decode that play faults on request,
and a gate in front of decode that plays the faults of the wire itself.

Faults the demo server can play through its Responder (500, hang, drop, die
mid-stream) are FaultyBackend's. Faults that break HTTP framing (bytes after a
complete response, Content-Length beside chunked, a hang-up after reading a
POST) need raw bytes, so decode is reached through FaultGate: a small HTTP/1.1
relay on its own port that hands each exchange to the real decode and writes
the answer back, breaking it when the request asks. The gate is what the proxy
sees as its decode backend, so it also counts the requests it receives per soak
id: a POST that arrives twice is a generation the proxy ran twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import socket
import struct
import time
from collections import Counter
from typing import Any

import h11
from soak_client import hostile_usage

from lowproxy.answers import json_body
from lowproxy.demo import DemoBackend, KvRegistry
from lowproxy.downstream import AbortResponse

# A whole second response, as a backend that owes one answer might write two.
STRAY_BODY = json_body({"id": "chatcmpl-stray", "object": "chat.completion",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "stray"}}]})


def stray(kind: str, soak_id: str | None) -> bytes:
    """The stray response written after ``soak_id``'s answer. Its x-soak-id
    (``stray-same-s12``, ``stray-later-s12``) names no request, so a client that
    receives it got a stray answer, and says which fault and answer it trailed."""
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"x-soak-id: stray-%s-%s\r\ncontent-length: %d\r\n\r\n"
            % (kind.encode(), (soak_id or "").encode(), len(STRAY_BODY))) + STRAY_BODY
# Linux's SO_TIMESTAMPNS (= SCM_TIMESTAMPNS), which Python's socket module does not
# name: the kernel stamps each received segment with its arrival (CLOCK_REALTIME).
SO_TIMESTAMPNS = 35
TIMESPEC = struct.Struct("@qq")

# How soon after a stray left the proxy's next request may arrive and still count as
# having crossed it (see GateLink._stray_later): longer than a busy 2-core host
# keeps a process off the CPU between its look at a pooled connection and its write.
CROSSING_GRACE = 0.025

# Sent beside Transfer-Encoding: chunked, smaller than any answer: a peer that
# framed by it (RFC 9112 6.3 says Transfer-Encoding wins) would stop mid-body
# and read the rest as the next answer.
WRONG_LENGTH = b"content-length: 10\r\n"


def soak_fields(body: bytes) -> tuple[str | None, str | None]:
    """The fault a request asks for and its soak id, from its JSON body."""
    if b"soak_" not in body:
        return None, None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(parsed, dict):
        return None, None
    fault, soak_id = parsed.get("soak_fault"), parsed.get("soak_id")
    return (fault if isinstance(fault, str) else None,
            soak_id if isinstance(soak_id, str) else None)


class FaultyBackend(DemoBackend):
    """A demo backend that plays the fault named in a request's ``soak_fault`` field."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received_ids: Counter[str] = Counter()  # generation requests, by soak id
        self.fault_of: dict[str, str] = {}  # soak id -> fault, for the report

    async def handle(self, request: Any, responder: Any) -> None:
        fault, soak_id = soak_fields(request.body) if request.method == b"POST" else (None, None)
        if soak_id:
            self.received_ids[soak_id] += 1
            self.fault_of[soak_id] = fault or "none"
        prefix = f"{self.role}_"
        if not fault or not fault.startswith(prefix):
            await super().handle(request, responder)
            return
        request.watch_client()  # a hang-up cancels us, as vLLM aborts
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
        elif kind == "hostile_usage":
            await self._hostile_usage(request, responder, soak_id)
        elif kind == "slow":
            await asyncio.sleep(random.uniform(0.1, 1.0))
            await super().handle(request, responder)
        else:  # the gate's kinds: decode itself answers normally
            await super().handle(request, responder)


    async def _hostile_usage(self, request: Any, responder: Any, soak_id: str | None) -> None:
        """A chat answer in vLLM's shape whose usage the proxy cannot rewrite."""
        usage = hostile_usage(soak_id).encode()
        if json.loads(request.body).get("stream") is not True:
            await responder.send_bytes(200, (
                b'{"id":"chatcmpl-hostile","object":"chat.completion","model":"demo-model",'
                b'"choices":[{"index":0,"message":{"role":"assistant","content":"hostile"},'
                b'"finish_reason":"stop"}],"usage":' + usage + b"}"))
            return
        await responder.start(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
        await responder.write(b'data: {"id":"chatcmpl-hostile","choices":[{"index":0,'
                              b'"delta":{"content":"hostile"}}]}\n\n')
        await responder.write(b'data: {"id":"chatcmpl-hostile","choices":[],"usage":'
                              + usage + b"}\n\n")
        await responder.write(b"data: [DONE]\n\n")
        await responder.end()


class FaultGate:
    """decode's front door: one HTTP/1.1 relay per proxy connection, faults on request."""

    def __init__(self, decode_port: int) -> None:
        self.decode_port = decode_port
        self.received: Counter[str] = Counter()  # requests the proxy sent, by soak id
        # Decode answers begun (a response head relayed), by soak id: a concurrent
        # handshake's decode leg closed while it waited for its failed prefill's
        # KV answered nothing and generated nothing; the recompute after it is
        # the one generation.
        self.answered: Counter[str] = Counter()
        self.fault_of: dict[str, str] = {}  # soak id -> fault, for the report
        # decode_stray_later: "sent" while the proxy's connection was idle, "skipped"
        # when the proxy had already sent something on it, "crossed" when its next
        # request came while the stray went out (see GateLink._stray_later) ...
        self.strays: Counter[str] = Counter()
        # ... and the x-soak-id of each crossed one: whoever it reaches got it by
        # HTTP/1.1's own ambiguity, not by the proxy's fault.
        self.crossed: set[str] = set()
        self.pending: set[str] = set()  # strays out, not yet judged crossed or not
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[GateLink] = set()

    async def start(self) -> FaultGate:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = GateLink(self, reader, writer)
        self._links.add(link)
        try:
            await link.run()
        except (ConnectionError, OSError, h11.ProtocolError):
            pass  # the proxy or decode went away: so does this link
        finally:
            link.close()
            self._links.discard(link)


class GateLink:
    """One connection from the proxy, and the gate's own keep-alive connection to decode."""

    def __init__(self, gate: FaultGate, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.gate, self.reader, self.writer = gate, reader, writer
        self.down = h11.Connection(h11.SERVER)  # towards the proxy
        self.up: tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection] | None = None
        self.swallow = False  # the next request crossed a stray: leave it unanswered
        sock = writer.get_extra_info("socket")
        if sock is not None:  # see _crossed
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

    def close(self) -> None:
        self.writer.close()  # a FIN, as a backend closing its socket sends
        if self.up is not None:
            self.up[1].transport.abort()
            self.up = None

    def abort(self) -> None:
        self.writer.transport.abort()
        if self.up is not None:
            self.up[1].transport.abort()

    async def run(self) -> None:
        while True:
            got = await self._request()
            if got is None:
                return
            request, body = got
            fault, soak_id = soak_fields(body)
            if soak_id:
                self.gate.received[soak_id] += 1
                self.gate.fault_of[soak_id] = fault or "none"
            if self.swallow:
                self.swallow = False
                self._resync()
                continue
            if fault == "decode_hangs_up" and soak_id and self.gate.received[soak_id] == 1:
                return  # the whole POST read, not one response byte written: hang up
            if not await self._exchange(request, body, fault, soak_id):
                return
            if self.down.our_state is not h11.DONE or self.down.their_state is not h11.DONE:
                return
            self.down.start_next_cycle()

    def _resync(self) -> None:
        """Past a request left unanswered: a fresh h11 state, fed what came after it."""
        leftover, closed = self.down.trailing_data
        self.down = h11.Connection(h11.SERVER)
        self.down.receive_data(leftover)
        if closed:
            self.down.receive_data(b"")

    async def _request(self) -> tuple[h11.Request, bytes] | None:
        request, parts = None, []
        while True:
            event = self.down.next_event()
            if event is h11.NEED_DATA:
                self.down.receive_data(await self.reader.read(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage) and request is not None:
                return request, b"".join(parts)
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter,
                                       h11.Connection]:
        if self.up is not None and self.up[0].at_eof():
            # decode closed the idle keep-alive connection: a fresh one, or this
            # request would be the gate's loss, not the proxy's.
            self.up[1].transport.abort()
            self.up = None
        if self.up is None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.gate.decode_port)
            self.up = (reader, writer, h11.Connection(h11.CLIENT))
        return self.up

    async def _exchange(self, request: h11.Request, body: bytes, fault: str | None,
                        soak_id: str | None) -> bool:
        """Hand one request to decode and its answer back; False: the connection ends."""
        up_reader, up_writer, up = await self._upstream()
        data = up.send(h11.Request(method=request.method, target=request.target,
                                   headers=list(request.headers)))
        if body:
            data += up.send(h11.Data(data=body))
        up_writer.write(data + up.send(h11.EndOfMessage()))
        watcher = asyncio.create_task(self._watch_proxy(up_writer))
        try:
            answered = await self._relay_answer(up_reader, up, fault, soak_id)
        finally:
            watcher.cancel()
            await asyncio.wait([watcher])  # off the reader before the next request's read
        if answered and fault == "decode_stray_later":
            await self._stray_later(soak_id)
        return answered

    async def _watch_proxy(self, up_writer: asyncio.StreamWriter) -> None:
        """While decode answers: a proxy that hangs up closes the decode leg, as it would
        on a direct connection (decode then aborts the generation)."""
        while True:
            try:
                data = await self.reader.read(65536)
            except ConnectionError:
                data = b""
            self.down.receive_data(data)  # kept for the next cycle, or the close
            if not data:
                up_writer.transport.abort()
                return

    async def _up_event(self, reader: asyncio.StreamReader, up: h11.Connection) -> Any:
        while True:
            try:
                event = up.next_event()
                if event is not h11.NEED_DATA:
                    return event
                up.receive_data(await reader.read(65536))
            except (ConnectionError, h11.RemoteProtocolError):
                return None

    async def _relay_answer(self, up_reader: asyncio.StreamReader, up: h11.Connection,
                            fault: str | None, soak_id: str | None) -> bool:
        event = await self._up_event(up_reader, up)
        while isinstance(event, h11.InformationalResponse):
            event = await self._up_event(up_reader, up)
        if not isinstance(event, h11.Response):
            return False  # decode closed without answering: so does the gate
        if soak_id:
            self.gate.answered[soak_id] += 1
        self.writer.write(self._head(event, fault, soak_id))
        while True:
            event = await self._up_event(up_reader, up)
            if isinstance(event, h11.EndOfMessage):
                break
            if not isinstance(event, h11.Data):
                return False  # decode cut its answer short: cut the proxy's too
            self.writer.write(self.down.send(h11.Data(data=event.data)))
            await self.writer.drain()
        tail = self.down.send(h11.EndOfMessage())
        if fault == "decode_stray_same":
            tail += stray("same", soak_id)  # in the same write as the end of the real answer
        self.writer.write(tail)
        await self.writer.drain()
        if up.our_state is h11.DONE and up.their_state is h11.DONE:
            up.start_next_cycle()
        else:
            assert self.up is not None
            self.up[1].transport.abort()
            self.up = None
        return True

    async def _stray_later(self, soak_id: str | None) -> None:
        """The stray response as a write of its own, a moment after the answer, and only
        while the proxy has sent nothing since: its connection is idle in the pool.

        A stray that reaches the proxy after it wrote its next request on the
        connection is, to any HTTP/1.1 client (httpcore, Go), that request's answer:
        nothing in RFC 9112 tells them apart, so sending it then would test nothing
        and blame the proxy for the protocol. Reading from the proxy is paused
        meanwhile, so whatever it sends stays in the kernel, where poll() sees it.
        When the proxy's next request reached the gate's socket before the stray
        left, or within CROSSING_GRACE after (by the kernel's receive time), it
        crossed the stray: the gate was descheduled between its look and its
        write, or the proxy between its own look (httpcore and Go look too) and its
        write; no HTTP/1.1 client can close that gap. The stray is recorded as
        crossed and that request is swallowed, unanswered:
        the proxy took the stray for its answer, and every later answer on the
        connection still lands on its own request.
        """
        transport = self.writer.transport
        transport.pause_reading()
        try:
            await asyncio.sleep(random.uniform(0.0005, 0.005))  # the proxy reads the end
            if self._proxy_spoke():
                self.gate.strays["skipped"] += 1
                return
            name = f"stray-later-{soak_id or ''}"
            self.gate.pending.add(name)  # whoever gets it waits for the verdict
            leaving = time.time_ns()
            self.writer.write(stray("later", soak_id))  # an empty buffer: sent at once
            await asyncio.sleep(CROSSING_GRACE)  # reading still paused
            if self._crossed(leaving + int(CROSSING_GRACE * 1e9)):
                self.gate.strays["crossed"] += 1
                self.gate.crossed.add(name)
                self.swallow = True
            else:
                self.gate.strays["sent"] += 1
            self.gate.pending.discard(name)
        finally:
            transport.resume_reading()

    def _proxy_spoke(self) -> bool:
        """Anything from the proxy since its last request: held by h11, by the stream
        reader (asyncio has no public way to ask), or still in the socket."""
        if self.down.trailing_data[0] or getattr(self.reader, "_buffer", b""):
            return True
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return True
        poll = select.poll()  # not select(): no FD_SETSIZE limit, as httpcore's check
        poll.register(sock.fileno(), select.POLLIN)
        return bool(poll.poll(0))

    def _crossed(self, leaving_ns: int) -> bool:
        """Whether bytes of the proxy's next request were in the socket before
        ``leaving_ns``, by their kernel receive time. Bytes that came later were
        written by a proxy that had long had the stray in its own socket: one that
        reads it as their answer never dropped the idle connection, and is not
        excused. (A proxy that looks only at what its event loop has delivered
        reuses it within the grace: tests/upstream/test_soak_findings.py catches that.) A
        FIN or a reset is the proxy dropping the connection, as it should."""
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        peek = socket.socket(fileno=os.dup(sock.fileno()))
        try:
            data, ancillary, _, _ = peek.recvmsg(
                1, socket.CMSG_SPACE(TIMESPEC.size), socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing yet (BlockingIOError), or a reset
            return False
        finally:
            peek.close()
        for level, kind, value in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and data:
                seconds, nanoseconds = TIMESPEC.unpack(value[:TIMESPEC.size])
                return seconds * 10**9 + nanoseconds < leaving_ns
        return False

    def _head(self, response: h11.Response, fault: str | None, soak_id: str | None) -> bytes:
        """decode's response head, with the request's x-soak-id (so a client can tell
        whose answer it got) and, for decode_cl_chunked, both framings."""
        both = fault == "decode_cl_chunked"
        headers = [(name, value) for name, value in response.headers
                   if not (both and name == b"content-length")]
        if soak_id:
            headers.append((b"x-soak-id", soak_id.encode()))
        if both and not any(name == b"transfer-encoding" for name, _ in headers):
            headers.append((b"transfer-encoding", b"chunked"))
        head = self.down.send(h11.Response(status_code=response.status_code, headers=headers,
                                           reason=response.reason))
        return head[:-2] + WRONG_LENGTH + b"\r\n" if both else head


async def start_backends() -> tuple[FaultyBackend, FaultyBackend, FaultGate]:
    registry = KvRegistry()
    # The prefill reports its cached-token figure, so the proxy rewrites decode's usage
    # (and decode_hostile_usage tests what it cannot rewrite).
    prefill = FaultyBackend("prefill", registry=registry, record=False,
                            prompt_tokens_details=True)
    decode = FaultyBackend("decode", registry=registry, record=False)
    await prefill.start("127.0.0.1", 0, bootstrap_port=0)
    await decode.start("127.0.0.1", 0, bootstrap_port=None)
    gate = await FaultGate(decode.port).start()
    return prefill, decode, gate
