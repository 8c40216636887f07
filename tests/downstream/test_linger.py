"""A refused upload still reads its answer: lingering close instead of a reset."""

from __future__ import annotations

import asyncio

from helpers import config_for, running_proxy


async def test_413_reaches_a_client_still_sending_its_body():
    async with running_proxy(config_for(decode="http://127.0.0.1:9",
                                        max_body_bytes=1024 * 1024)) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body_size = 3 * 1024 * 1024
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % body_size)

        async def upload() -> None:
            chunk = b"x" * 65536
            try:
                for _ in range(body_size // len(chunk)):
                    writer.write(chunk)
                    await writer.drain()
            except ConnectionError:
                pass

        sending = asyncio.ensure_future(upload())
        received = b""
        try:
            while True:
                data = await asyncio.wait_for(reader.read(65536), 10)
                if not data:
                    break
                received += data
        except ConnectionResetError:  # what a plain close with unread input gives
            raise AssertionError(f"connection reset after {received[:40]!r}") from None
        await sending
        assert received.startswith(b"HTTP/1.1 413 ")
        assert received.endswith(b"}")  # the whole JSON body, then a clean end
        writer.close()
        # The proxy still serves.
        assert (await proxy.request("GET", "/healthz")).status == 200
