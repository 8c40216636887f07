"""Issue 19 over sockets: SGLang aborts that its servers accept, and legs not waited for.

The demo backends run as SGLang PD servers: ``/abort_request`` needs the
``--api-key`` like every other path, aborts the exact rid only (one tokenizer
worker), and a batch ends once each of its children (``<rid>_<i>``) is aborted.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from helpers import (
    CHAT,
    chat,
    config_for,
    free_port,
    leave_after_both_legs,
    pd_setup,
    request,
    running_proxy,
    wait_until,
)
from lowproxy.demo import start_pair

KEY = "sglang-backend-key"
COMPLETIONS = "/v1/completions"


@contextlib.asynccontextmanager
async def keyed_sglang(**overrides: Any) -> AsyncIterator[Any]:
    prefill, decode = await start_pair(api_key=KEY, sglang_pd=True)
    try:
        async with running_proxy(config_for(prefill.url, decode.url, kv_protocol="sglang",
                                            backend_api_key=KEY, **overrides)) as proxy:
            yield proxy, prefill, decode
    finally:
        await prefill.close()
        await decode.close()


def abort_headers(backend) -> list[bytes | None]:
    return [r.header("authorization") for r in backend.requests_to("/abort_request")]


async def test_aborts_carry_the_backend_key_and_are_accepted():
    async with keyed_sglang() as (proxy, prefill, decode):
        prefill.faults.delay = 0.5
        await leave_after_both_legs(proxy, prefill, decode, chat(stream=True))
        rid = decode.requests_to(CHAT)[0].body["rid"]
        # Recorded only past SGLang's --api-key check: a keyless abort is a 401.
        await wait_until(lambda: decode.abort_requests == [rid], what="decode aborted")
        await wait_until(lambda: prefill.abort_requests == [rid], what="prefill aborted")
        assert abort_headers(decode) == abort_headers(prefill) == [f"Bearer {KEY}".encode()]


async def test_a_keyless_abort_is_refused_by_the_demo_as_by_sglang():
    prefill, decode = await start_pair(api_key=KEY, sglang_pd=True)
    try:
        refused = await request(decode.port, "POST", "/abort_request", {"rid": "x"})
        assert refused.status == 401 and decode.abort_requests == []
        health = await request(decode.port, "GET", "/health")
        assert health.status == 200  # SGLang leaves /health open
    finally:
        await prefill.close()
        await decode.close()


async def test_n_children_are_each_aborted_by_their_own_rid():
    async with pd_setup("sglang") as (proxy, prefill, decode):
        prefill.faults.delay = 0.5
        await leave_after_both_legs(proxy, prefill, decode, chat(stream=True, n=2))
        rid = decode.requests_to(CHAT)[0].body["rid"]
        children = [f"{rid}_0", f"{rid}_1"]
        await wait_until(lambda: decode.abort_requests == children, what="decode children")
        await wait_until(lambda: prefill.abort_requests == children, what="prefill children")
        # Every child aborted: the prefill's batch ends at once, as SGLang's would.
        await wait_until(lambda: prefill.aborted == [rid], what="prefill batch ended")


async def test_a_failed_prefill_of_a_batch_aborts_each_decode_child():
    async with pd_setup("sglang") as (proxy, prefill, decode):
        prefill.faults.status = 503
        body = {"model": "demo-model", "prompt": ["a", "b", "c"], "max_tokens": 2}
        reply = await proxy.request("POST", COMPLETIONS, body)
        assert reply.status == 502 and reply.json()["error"]["type"] == "prefill_failed"
        [leg] = decode.requests_to(COMPLETIONS)
        rid = leg.body["rid"]
        await wait_until(lambda: decode.abort_requests == [f"{rid}_{i}" for i in range(3)],
                         what="each child aborted")


async def test_decode_failing_first_closes_and_aborts_the_running_prefill():
    # A prefill timeout far beyond the client's: waiting for prefill would time out.
    async with pd_setup("sglang", prefill_timeout=60) as (proxy, prefill, decode):
        prefill.faults.hang = True
        decode.faults.status = 503
        reply = await proxy.request("POST", CHAT, chat(), timeout=10)
        assert reply.status == 503  # decode's own answer, at once
        rid = prefill.requests_to(CHAT)[0].body["rid"]
        await wait_until(lambda: prefill.abort_requests == [rid], what="prefill aborted")
        await wait_until(lambda: not prefill._inflight, what="prefill leg ended")


async def test_unreachable_decode_closes_and_aborts_the_running_prefill():
    prefill, decode = await start_pair(sglang_pd=True)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        async with running_proxy(config_for(prefill.url, dead, kv_protocol="sglang",
                                            prefill_timeout=60)) as proxy:
            prefill.faults.hang = True
            reply = await proxy.request("POST", CHAT, chat(), timeout=10)
            assert reply.status in (502, 503), reply.body
            rid = prefill.requests_to(CHAT)[0].body["rid"]
            await wait_until(lambda: prefill.abort_requests == [rid], what="prefill aborted")
            await wait_until(lambda: not prefill._inflight, what="prefill leg ended")
    finally:
        await prefill.close()
        await decode.close()


async def test_under_mooncake_a_decode_error_is_relayed_and_prefill_closed():
    """Decode's error is its final answer: it will never pull the KV, which a
    Mooncake prefill left to finish would pin for 480 s. Closed, vLLM aborts it."""
    async with pd_setup("mooncake", prefill_timeout=60) as (proxy, prefill, decode):
        prefill.faults.delay = 1.0
        decode.faults.status = 503
        reply = await proxy.request("POST", CHAT, chat(), timeout=10)
        assert reply.status == 503
        await wait_until(lambda: prefill.abandoned == 1, what="prefill leg closed")
        assert prefill.abort_requests == []  # vLLM has no abort route: the close is it
        assert not prefill.registry._ready  # no KV computed for nobody
        assert proxy.proxy.metrics.prefill_legs.get("mooncake", "ok") == 0
