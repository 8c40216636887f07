"""Upstream responses in awkward pieces: the head-only read and the fast chunked relay.

A raw TCP backend writes its response split at chosen offsets (each piece a
separate segment), so the proxy's stream sees a head cut anywhere, including
between the two line ends of the blank line, and body bytes in the head's
segment. The client must get the exact body, and the upstream connection must
stay reusable (h11 and the fast decoder agree on where the body ended).
"""

from __future__ import annotations

import asyncio

import pytest

from helpers import RawServer, config_for, read_request, running_proxy

EVENTS = [b"data: {\"i\": %d}\n\n" % i for i in range(5)]
CHUNKED = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
WIRE = HEAD + CHUNKED


class RawBackend(RawServer):
    def __init__(self, responses: list[list[bytes]]) -> None:
        super().__init__()
        self.responses = responses  # one list of pieces per request, in order
        self.requests = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    number: int) -> None:
        while True:
            await read_request(reader)
            pieces = self.responses[min(self.requests, len(self.responses) - 1)]
            self.requests += 1
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.005)


def split_at(data: bytes, *offsets: int) -> list[bytes]:
    bounds = [0, *offsets, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


BLANK = len(HEAD) - 4  # where the blank line's "\r\n\r\n" starts
SPLITS = [(), (BLANK,), (BLANK + 1,), (BLANK + 2,), (BLANK + 3,), (len(HEAD),),
          (len(HEAD) + 3,), (10, BLANK + 2, len(HEAD) + 1), tuple(range(1, len(WIRE)))]


@pytest.mark.parametrize("offsets", SPLITS, ids=[str(len(s)) + "-" + "-".join(map(str, s[:3]))
                                                  for s in SPLITS])
async def test_split_responses_relay_exactly_and_keep_the_connection(offsets):
    backend = RawBackend([split_at(WIRE, *offsets)])
    port = (await backend.start()).port
    try:
        async with running_proxy(config_for(decode=f"http://127.0.0.1:{port}")) as proxy:
            for _ in range(3):
                reply = await proxy.request("POST", "/v1/completions",
                                            {"prompt": "x", "stream": True})
                assert reply.status == 200 and reply.complete
                assert reply.body == b"".join(EVENTS)
        assert backend.requests == 3
        assert backend.connections == 1  # the connection was reused every time
    finally:
        await backend.close()


async def test_bytes_after_the_body_retire_the_connection():
    extra = HEAD + CHUNKED + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
    backend = RawBackend([[extra], [WIRE]])
    port = (await backend.start()).port
    try:
        async with running_proxy(config_for(decode=f"http://127.0.0.1:{port}")) as proxy:
            first = await proxy.request("POST", "/v1/completions", {"prompt": "x",
                                                                     "stream": True})
            second = await proxy.request("POST", "/v1/completions", {"prompt": "x",
                                                                      "stream": True})
        # The body itself was whole: the client gets it complete; the stray
        # bytes only retire the connection.
        assert first.status == 200 and first.complete and first.body == b"".join(EVENTS)
        assert second.status == 200 and second.complete
        assert backend.connections == 2  # never reused after the stray bytes
    finally:
        await backend.close()


async def test_broken_chunk_framing_cuts_the_client_response():
    broken = HEAD + b"5\r\nhelloXX0\r\n\r\n"
    backend = RawBackend([[broken]])
    port = (await backend.start()).port
    try:
        async with running_proxy(config_for(decode=f"http://127.0.0.1:{port}")) as proxy:
            reply = await proxy.request("POST", "/v1/completions", {"prompt": "x",
                                                                     "stream": True})
        assert reply.status == 200
        assert not reply.complete  # truncated, never a clean end
        assert b"XX" not in reply.body
    finally:
        await backend.close()
