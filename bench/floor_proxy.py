"""The floor under the brief's constraints: a relay PD proxy with no features at all.

Issue 21 asks whether a target is out of reach under the brief's constraints;
this answers it by measurement. It is what the constraints leave when every
feature is taken away: ``asyncio.start_server`` and h11 towards the client, h11
driven on pooled keep-alive connections upstream, the response parsed inside
``data_received`` (the fastest of issue 21's prototypes), one prefill leg (one
token, not streamed, KV kept for a remote decode), then decode's answer: its
head through the client's h11, its body spliced (decode's bytes written to the
client as they arrive, chunked framing and all, its end found by its length or
by the last chunk's bytes). No routing, keys, metrics, logs, limits, timeouts,
health or error answers, no pipelining, no checks of decode's framing; one
prefill and one decode (the first of each list); relay only.
Not a proxy to run: a yardstick for bench/load.py,

    python bench/load.py --scenario chat,latency --peer vllm-router \\
        --proxy-cmd "python bench/floor_proxy.py"

so that lowproxy's figures can be read against what no Python proxy under
these constraints can beat on the same machine, in the same hour.
Reads PD_PROXY_HOST, PD_PROXY_PORT, PD_PROXY_PREFILL_URL, PD_PROXY_DECODE_URL and
PD_PROXY_LOOP (``uvloop``: uvloop, when installed) as lowproxy does.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Callable
from urllib.parse import urlsplit

import h11

KV_TO_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
HOP_BY_HOP = {b"connection", b"keep-alive"}


def address(urls: str) -> tuple[str, int]:
    url = urlsplit(urls.split(",")[0].strip())
    return url.hostname or "127.0.0.1", url.port or 80


class Upstream(asyncio.Protocol):
    """One keep-alive connection to a backend; h11's events handled as bytes arrive."""

    def __init__(self) -> None:
        self.conn = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.on_head: Callable[[Any], tuple[Callable[[bytes], None], int | None]] | None = None
        self.splice: Callable[[bytes], None] | None = None
        self.left: int | None = None
        self.tail = b""
        self.chunks: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.splice is not None:
            self.splice_bytes(data)
            return
        conn = self.conn
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                return
            kind = type(event)
            if kind is h11.EndOfMessage:
                self.finish()
                return
            if kind is h11.Data:
                self.chunks.append(event.data)
            elif kind is h11.Response and self.on_head is not None:
                # The body is spliced: decode's bytes go to the client as they come,
                # its framing (chunked or a length) copied, not parsed again.
                self.splice, length = self.on_head(event)
                self.left = length
                self.tail = b""
                self.conn = h11.Connection(h11.CLIENT)  # the next cycle's state
                rest = conn.trailing_data[0]
                if rest:
                    self.splice_bytes(rest)
                elif length == 0:
                    self.finish()
                return

    def splice_bytes(self, data: bytes) -> None:
        assert self.splice is not None
        self.splice(data)
        if self.left is not None:  # content-length
            self.left -= len(data)
            if self.left <= 0:
                self.finish()
        else:  # chunked: the last chunk is the empty one (good enough for a yardstick)
            self.tail = (self.tail + data)[-7:]
            if self.tail.endswith(b"\r\n0\r\n\r\n") or self.tail == b"0\r\n\r\n":
                self.finish()

    def finish(self) -> None:
        self.splice = None
        done, self.done = self.done, None
        if done is not None and not done.done():
            done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("backend closed the connection"))


class Floor:
    def __init__(self, prefill: tuple[str, int], decode: tuple[str, int]) -> None:
        self.pools: dict[tuple[str, int], list[Upstream]] = {prefill: [], decode: []}
        self.prefill, self.decode = prefill, decode

    async def exchange(self, where: tuple[str, int], target: bytes, body: bytes,
                       on_head: Callable[[Any], tuple[Callable[[bytes], None], int | None]]
                       | None = None) -> bytes:
        pool, loop = self.pools[where], asyncio.get_running_loop()
        if pool:
            up = pool.pop()
        else:
            _, up = await loop.create_connection(Upstream, *where)
        conn = up.conn
        up.chunks, up.on_head, up.done = [], on_head, loop.create_future()
        assert up.transport is not None
        up.transport.write(
            conn.send(h11.Request(method="POST", target=target, headers=[
                ("host", f"{where[0]}:{where[1]}"), ("content-type", "application/json"),
                ("content-length", str(len(body)))]))
            + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await up.done
        if on_head is not None:
            pool.append(up)  # spliced to its end: a fresh h11 state is in place
        elif conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            pool.append(up)
        else:
            up.transport.close()
        return b"".join(up.chunks)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, parts = None, []
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        if not data:
                            return
                        conn.receive_data(data)
                    elif type(event) is h11.Request:
                        request = event
                    elif type(event) is h11.Data:
                        parts.append(event.data)
                    elif type(event) is h11.EndOfMessage:
                        break
                    else:
                        return
                assert request is not None
                conn = await self.relay(conn, writer, request.target,
                                        json.loads(b"".join(parts)))
        except (ConnectionError, h11.ProtocolError):
            pass
        finally:
            writer.close()

    async def relay(self, conn: h11.Connection, writer: asyncio.StreamWriter, target: bytes,
                    body: dict[str, Any]) -> h11.Connection:
        """Both legs; decode's answer spliced to the client. Returns the client
        connection's h11 state for the next request."""
        leg = dict(body, max_tokens=1, stream=False, ignore_eos=True,
                   kv_transfer_params=KV_TO_PREFILL)
        answer = json.loads(await self.exchange(self.prefill, target, json.dumps(
            leg, separators=(",", ":")).encode()))
        kv = dict(answer["kv_transfer_params"], do_remote_prefill=True, do_remote_decode=False)

        def to_client(head: Any) -> tuple[Callable[[bytes], None], int | None]:
            headers = [(k, v) for k, v in head.headers if k not in HOP_BY_HOP]
            length = next((int(v) for k, v in headers if k == b"content-length"), None)
            # The client's h11 writes the head; the body is decode's bytes as they are.
            writer.write(conn.send(h11.Response(status_code=head.status_code, headers=headers)))
            return writer.write, length

        await self.exchange(self.decode, target, json.dumps(
            dict(body, kv_transfer_params=kv), separators=(",", ":")).encode(), to_client)
        # The client's h11 believes no body was sent: a fresh state for the next request.
        return h11.Connection(h11.SERVER)


async def main() -> None:
    floor = Floor(address(os.environ["PD_PROXY_PREFILL_URL"]),
                  address(os.environ["PD_PROXY_DECODE_URL"]))
    server = await asyncio.start_server(floor.serve, os.environ.get("PD_PROXY_HOST", "127.0.0.1"),
                                        int(os.environ.get("PD_PROXY_PORT", "8000")),
                                        backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if os.environ.get("PD_PROXY_LOOP") == "uvloop":
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
