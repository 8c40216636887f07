"""The concurrent handshakes' wait (prefill_watch.py): decode's head is awaited in the
request's own task, and a prefill leg that fails interrupts only that wait.

The prefill leg outlives its request (a vLLM prefill is left to finish), so its
failure may come while the same client connection serves its next request: that
request must not notice. A prefill that fails after decode's 2xx head arrived
closes that held decode leg, and decode recomputes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from helpers import CHAT, ScriptedBackend, chat, config_for, pd_setup, running_proxy, wait_until
from helpers.client import Client
from lowproxy.demo import start_pair


async def test_a_late_prefill_failure_leaves_the_next_request_on_the_connection_alone():
    async with pd_setup("mooncake", prefill_timeout=60) as (proxy, prefill, decode):
        prefill.faults.delay = 0.5  # then answers 500: long after its request ended
        prefill.faults.status = 500
        # Decode hangs up without an answer: the client's 502 at once, and the
        # prefill left to finish (that decode may have begun pulling its KV).
        decode.faults.close_without_response = True
        client = await Client.open(proxy.port)
        try:
            client.send("POST", CHAT, chat())
            first = await client.reply()
            assert first.status == 502
            metrics = proxy.proxy.metrics
            assert metrics.prefill_legs.get("mooncake", "error") == 0  # still running
            # The next request on the same connection goes to decode alone (echo)
            # and is still waiting for decode when the first one's prefill fails.
            decode.faults.close_without_response = False
            decode.faults.delay = 1.0
            client.send("POST", CHAT, chat(echo=True))
            second = await client.reply(timeout=10)
            assert second.status == 200 and second.complete, second.body
            assert second.json()["choices"][0]["message"]["content"]
            assert metrics.prefill_legs.get("mooncake", "error") == 1  # it failed meanwhile
        finally:
            client.close()


async def _head_at_once(request: Any, responder: Any) -> None:
    """A decode that answers its head before any KV arrived, and its body much later;
    without kv_transfer_params (the recompute) it answers at once."""
    body = json.loads(request.body)
    if "kv_transfer_params" not in body:
        await responder.send_json(200, {"recomputed": True})
        return
    await responder.start(200, [(b"content-type", b"text/event-stream")], None)
    responder.flush()  # the head goes out now
    await asyncio.sleep(30)


async def test_prefill_failing_after_decodes_head_closes_that_decode_leg_and_recomputes():
    prefill, unused = await start_pair()
    await unused.close()  # decode is the scripted one
    decode = await ScriptedBackend(_head_at_once).start()
    try:
        config = config_for(f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}",
                            decode.url(), kv_protocol="mooncake",
                            mooncake_bootstrap_port=prefill.bootstrap_port)
        async with running_proxy(config) as proxy:
            prefill.faults.delay = 0.5
            prefill.faults.status = 500
            reply = await proxy.request("POST", CHAT, chat(stream=True), timeout=10)
            assert reply.status == 200 and reply.json() == {"recomputed": True}
            first, second = decode.received
            assert "transfer_id" in first.body["kv_transfer_params"]
            assert "kv_transfer_params" not in second.body
            await wait_until(lambda: decode.hung_up == 1, what="held decode leg closed")
            [endpoint] = proxy.proxy.decode.endpoints
            assert endpoint.in_flight == 0  # closed by the proxy, not left to the collector
            assert endpoint.open == len(endpoint.idle) == 1  # the recompute's, pooled
            assert proxy.proxy.metrics.prefill_legs.get("mooncake", "error") == 1
    finally:
        await decode.close()
        await prefill.close()
