"""A stream that lasts minutes holds no copy of its request's prompt (issue 21).

Routing (cache-aware, the default) renders the prompt and keeps the client's body
beside the prefix hashes for its choice; once the choice is made neither may live
as long as the stream. Over real sockets: the demo backends in a process of their
own (so that the only parsed copies of the prompt are the proxy's), the proxy in
this one, a stream left open while the heap is searched for the prompt's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
from typing import AsyncIterator

import pytest

from helpers import config_for, running_proxy
from helpers.client import Client
from lowproxy.handshakes.legs import Plan

MARKER = "a prompt nobody else holds " + "x" * 3000


def _prompt_dicts() -> list[list]:
    """Message lists holding the prompt (a dict of strings alone is not tracked by the
    collector, the list of messages holding it is)."""
    gc.collect()
    return [o for o in gc.get_objects()
            if type(o) is list and any(type(m) is dict and m.get("content") == MARKER
                                       for m in o)]


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_an_open_stream_keeps_no_parsed_prompt(kv_protocol):
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lowproxy.demo", "--stream-chunks", "200", "--chunk-delay", "0.05",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert demo.stdout is not None
        info = json.loads(await demo.stdout.readline())
        prefill = f"{info['prefill']}#bootstrap_port={info['bootstrap_port']}"
        config = config_for(prefill, info["decode"], kv_protocol=kv_protocol,
                            prefill_policy="cache-aware",
                            mooncake_bootstrap_port=info["bootstrap_port"])
        async with running_proxy(config) as proxy:
            client = await Client.open(proxy.port)
            try:
                client.send("POST", "/v1/chat/completions", raw_body=json.dumps({
                    "model": "demo-model", "stream": True, "max_tokens": 200,
                    "messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": MARKER}]}).encode())
                streamed = await client.read_until(b"data: ", timeout=10)
                assert streamed.status == 200
                assert _prompt_dicts() == []  # the stream runs on; the prompt is gone
                assert proxy.proxy.router is not None  # cache-aware routed it
            finally:
                client.close()
    finally:
        demo.terminate()
        await demo.wait()


class HeldLeg:
    """A backend that takes one leg and answers it only when told: the proxy waits for
    that answer meanwhile. The body is read as bytes (no parsed copy of the prompt in
    this process but the proxy's)."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.answer = b""  # empty: the connection is closed without an answer
        self.received = b""
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        self.received = head + await reader.readexactly(length)
        self.arrived.set()
        await self.release.wait()
        writer.write(self.answer)
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        self.release.set()
        assert self.server is not None
        self.server.close()


async def _demo() -> tuple[asyncio.subprocess.Process, dict]:
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lowproxy.demo", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    assert demo.stdout is not None
    return demo, json.loads(await demo.stdout.readline())


def _chat() -> bytes:
    return json.dumps({"model": "demo-model", "max_tokens": 4,
                       "messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": MARKER}]}).encode()


async def test_relay_waiting_for_prefill_keeps_no_parsed_prompt_and_falls_back_to_it():
    """The client's body is encoded once prefill's leg is sent; from then on a request
    waiting for prefill (a connect storm keeps thousands waiting, and that peak is
    what the process's memory keeps) holds the encoding, not the parsed prompt. The
    encoding is also the recompute fallback's body: decode gets the client's body."""
    demo, info = await _demo()
    prefill = HeldLeg()
    try:
        config = config_for(await prefill.start(), info["decode"], kv_protocol="relay")
        async with running_proxy(config) as proxy:
            client = await Client.open(proxy.port)
            try:
                client.send("POST", "/v1/chat/completions", raw_body=_chat())
                await asyncio.wait_for(prefill.arrived.wait(), 10)
                assert MARKER.encode() in prefill.received
                assert _prompt_dicts() == []
                prefill.release.set()  # closed unanswered: decode recomputes the prompt
                answer = await client.reply(timeout=10)
                assert answer.status == 200, answer.body
                assert json.loads(answer.body)["choices"][0]["message"]["content"]
            finally:
                client.close()
    finally:
        await prefill.stop()
        demo.terminate()
        await demo.wait()


DECODE_ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"content-length: 2\r\nconnection: close\r\n\r\n{}")


@contextlib.asynccontextmanager
async def _decode_held(kv_protocol: str) -> AsyncIterator[HeldLeg]:
    """A request through the proxy whose decode leg is held while the body runs; then
    decode answers, and the client gets that answer."""
    demo, info = await _demo()
    decode = HeldLeg()
    decode.answer = DECODE_ANSWER
    try:
        prefill = f"{info['prefill']}#bootstrap_port={info['bootstrap_port']}"
        config = config_for(prefill, await decode.start(), kv_protocol=kv_protocol,
                            mooncake_bootstrap_port=info["bootstrap_port"])
        async with running_proxy(config) as proxy:
            client = await Client.open(proxy.port)
            try:
                client.send("POST", "/v1/chat/completions", raw_body=_chat())
                await asyncio.wait_for(decode.arrived.wait(), 10)
                yield decode
                decode.release.set()
                answer = await client.reply(timeout=10)
                assert (answer.status, answer.body) == (200, b"{}")
            finally:
                client.close()
    finally:
        await decode.stop()
        demo.terminate()
        await demo.wait()


def _the_plan() -> Plan:
    plans = [o for o in gc.get_objects() if type(o) is Plan]
    assert len(plans) == 1
    return plans[0]


async def test_relay_waiting_for_decode_head_keeps_no_parsed_prompt():
    """Once decode's body is made, neither the parsed prompt nor prefill's body is
    kept while decode's response head is awaited."""
    async with _decode_held("relay") as decode:
        assert b'"kv_transfer_params":' in decode.received
        assert _prompt_dicts() == []
        # Nor prefill's body, nor the client's encoding (bytes: not tracked by the
        # collector, so the plan that held them is looked at).
        plan = _the_plan()
        assert (plan.prefill_body, plan.decode_body_for, plan.fallback, plan.client_body) \
            == (b"", None, None, None)


async def test_mooncake_with_both_legs_running_keeps_no_parsed_prompt():
    """Mooncake's recompute fallback is cut from decode's bytes: while decode's head is
    awaited (prefill may still fail, and then decode gets the client's body), no
    parsed prompt is kept."""
    async with _decode_held("mooncake") as decode:
        assert b'"transfer_id":' in decode.received
        assert _prompt_dicts() == []
        plan = _the_plan()
        assert plan.client_body is None
        assert json.loads(plan.fallback_body()) == json.loads(_chat())
