"""A fault storm leaves nothing behind: file descriptors, tasks, pool counts at baseline.

A few hundred requests run in phases, each phase with one backend fault
(decode dying mid-stream, decode closing without an answer, prefill 500s,
prefill hanging past its timeout) while clients, concurrently, finish
normally, vanish mid-body, vanish mid-stream or send garbage. Afterwards, once
idle pooled upstream connections are closed (they are legitimately open), the
process's open descriptors and asyncio tasks must return to their baseline,
and every endpoint's in-flight and open counts to zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

from helpers import CHAT, chat, pd_setup, raw_exchange, wait_until

PHASES = ("decode dies", "decode closes", "prefill 500", "prefill hangs", "no fault")
CLIENTS = ("normal", "normal", "vanish mid-body", "vanish mid-stream", "garbage")
PER_PHASE = 60
CONCURRENCY = 20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def set_phase(phase: str, prefill, decode) -> None:
    prefill.faults.status = 500 if phase == "prefill 500" else None
    prefill.faults.hang = phase == "prefill hangs"
    decode.faults.die_after_chunks = 3 if phase == "decode dies" else None
    decode.faults.close_without_response = phase == "decode closes"


async def one_client(port: int, kind: str, outcomes: dict[str, int]) -> None:
    body = json.dumps(chat(stream=True)).encode()
    head = (b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (CHAT.encode(), len(body)))
    if kind == "garbage":
        raw = await raw_exchange(port, b"\x16\x03\x01\x02\x00garbage\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 400 ")
        outcomes["garbage"] = outcomes.get("garbage", 0) + 1
        return
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if kind == "vanish mid-body":
            writer.write(head + body[:10])
            await writer.drain()
            await asyncio.sleep(random.uniform(0, 0.02))
            writer.transport.abort()
            outcomes[kind] = outcomes.get(kind, 0) + 1
            return
        writer.write(head + body)
        await writer.drain()
        if kind == "vanish mid-stream":
            await asyncio.wait_for(reader.read(1), 10)  # something came back
            writer.transport.abort()
            outcomes[kind] = outcomes.get(kind, 0) + 1
            return
        raw = b""
        while not raw.endswith(b"\r\n0\r\n\r\n"):  # a whole response, or the close
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                break
            raw += data
            if raw.startswith(b"HTTP/1.1 5") and b"\r\n\r\n{" in raw and raw.endswith(b"}"):
                break
        status = raw[9:12].decode() or "none"
        complete = raw.endswith(b"\r\n0\r\n\r\n") or raw.endswith(b"}")
        label = f"{status} {'complete' if complete else 'cut'}"
        outcomes[label] = outcomes.get(label, 0) + 1
    finally:
        writer.close()


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_fault_storm_leaves_no_descriptors_tasks_or_pool_counts(kv_protocol):
    random.seed(5)
    async with pd_setup(kv_protocol, prefill_timeout=0.2) as (proxy, prefill, decode):
        prefill.record = decode.record = False
        decode.stream_chunks, decode.chunk_delay = 8, 0.005
        endpoints = lambda: list(proxy.proxy.all_endpoints())  # noqa: E731

        async def settled(fds: int, tasks: int) -> None:
            for endpoint in endpoints():
                proxy.proxy.upstream.close_idle(endpoint)
            await wait_until(lambda: not proxy.server.connections
                             and not decode.server.connections
                             and not prefill.server.connections, timeout=10,
                             what="client and backend connections closed")
            await wait_until(lambda: open_fds() <= fds and len(asyncio.all_tasks()) <= tasks,
                             timeout=10, what=f"fds {open_fds()}/{fds}, "
                             f"tasks {len(asyncio.all_tasks())}/{tasks}")

        # Baseline after a warm-up: lazily made things (bootstrap entries, pools) exist.
        for _ in range(3):
            reply = await proxy.request("POST", CHAT, chat(stream=True))
            assert reply.status == 200 and reply.complete
        await settled(10**6, 10**6)
        await asyncio.sleep(0.2)
        fds, tasks = open_fds(), len(asyncio.all_tasks())

        outcomes: dict[str, int] = {}
        limit = asyncio.Semaphore(CONCURRENCY)

        async def limited(kind: str) -> None:
            async with limit:
                await one_client(proxy.port, kind, outcomes)

        for phase in PHASES:
            set_phase(phase, prefill, decode)
            kinds = [CLIENTS[i % len(CLIENTS)] for i in range(PER_PHASE)]
            random.shuffle(kinds)
            await asyncio.gather(*(limited(kind) for kind in kinds))
        set_phase("no fault", prefill, decode)

        assert sum(outcomes.values()) == PER_PHASE * len(PHASES)
        # The faults happened and were seen as such by clients.
        assert outcomes.get("200 cut", 0) > 0, outcomes  # decode died mid-stream
        assert outcomes.get("502 complete", 0) > 0, outcomes  # decode closed, no answer
        assert outcomes.get("200 complete", 0) > 0, outcomes
        assert not any(label.startswith("500") for label in outcomes), outcomes

        await settled(fds, tasks)
        for endpoint in endpoints():
            assert endpoint.in_flight == 0 and endpoint.open == 0, endpoint
        assert decode.open_streams == 0
        assert proxy.proxy.metrics.in_flight.values.get((), 0) == 0
        # And the proxy still serves.
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 200 and reply.complete
