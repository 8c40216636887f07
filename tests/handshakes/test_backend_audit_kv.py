"""What an audit of hostile backends found in the handshakes (session 36).

- A prefill answering a half-filled kv_transfer_params had it relayed to
  decode: a NIXL decode given ``do_remote_prefill`` without
  ``remote_block_ids`` asserts and takes its engine core down (PROTOCOL.md).
- A Mooncake bootstrap query that failed after every waiting client had left
  printed "Task exception was never retrieved" with a traceback.
- A prefill's 429 was logged as a misconfigured server.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from helpers import chat, pd_setup
from lowproxy.config import Config, parse_endpoint
from lowproxy.handshakes import bootstrap
from lowproxy.handshakes.bootstrap import BootstrapCache, BootstrapError
from lowproxy.handshakes.legs import half_filled, relay_decode_params
from lowproxy.proxy.failures import prefill_outcome
from lowproxy.tls import TrustStore
from lowproxy.upstream import Endpoint
from lowproxy.upstream.pool import Upstream

HALF_FILLED = {
    "engine id without block ids": {"remote_engine_id": "e", "remote_host": "h",
                                    "remote_port": 1},
    "block ids not a list": {"remote_block_ids": "oops", "remote_engine_id": "e"},
    "flags only": {"do_remote_decode": False, "do_remote_prefill": True},
}
USABLE = {
    "nixl": {"remote_block_ids": [[1, 2]], "remote_engine_id": "e", "tp_size": 1},
    "nixl, no blocks": {"remote_block_ids": [[]], "remote_engine_id": "e"},
    "older mooncake": {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_host": "127.0.0.1", "remote_port": 7},
    "a connector lowproxy does not know": {"disagg_spec": {"receiver": "x"}},
}


@pytest.mark.parametrize("kv", list(HALF_FILLED.values()), ids=list(HALF_FILLED))
def test_a_half_filled_dict_never_reaches_decode(kv):
    assert half_filled(kv)
    assert relay_decode_params(kv) is None


@pytest.mark.parametrize("kv", list(USABLE.values()), ids=list(USABLE))
def test_what_a_connector_needs_is_relayed(kv):
    assert half_filled(kv) is None
    relayed = relay_decode_params(kv)
    assert relayed == {**kv, "do_remote_prefill": True, "do_remote_decode": False}


@pytest.mark.parametrize("kv", list(HALF_FILLED.values()), ids=list(HALF_FILLED))
async def test_end_to_end_decode_recomputes_and_survives_a_half_filled_answer(kv, caplog):
    caplog.set_level(logging.WARNING)
    async with pd_setup() as (proxy, prefill, decode):
        prefill.faults.kv_params = kv
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        # The strict demo decode dies as NIXL's does on such a dict: 200 shows it
        # never saw one.
        assert reply.status == 200, reply.body
        [leg] = decode.received
        assert "kv_transfer_params" not in leg.body
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
    assert any("decode cannot use" in record.getMessage()
               and record.fields.get("backend") == prefill.url.rstrip("/").lower()
               for record in caplog.records if hasattr(record, "fields"))


async def test_a_failed_bootstrap_query_nobody_waits_for_leaves_no_unretrieved_error(
        monkeypatch):
    monkeypatch.setattr(bootstrap, "QUERY_TIMEOUT_SECONDS", 0.2)
    unheard: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unheard.append(context))
    accepted: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _, writer: accepted.append(writer),
                                        "127.0.0.1", 0)  # accepts, never answers
    port = silent.sockets[0].getsockname()[1]
    upstream = Upstream(Config(), TrustStore(None))
    cache = BootstrapCache(upstream, port)
    endpoint = Endpoint(parse_endpoint("http://127.0.0.1:9"))
    try:
        waiter = asyncio.ensure_future(cache.engines(endpoint))
        await asyncio.sleep(0.05)
        waiter.cancel()  # the client left; the query goes on for the others
        await asyncio.sleep(0.4)  # it fails now, with no one left to hear it
        del waiter  # its frame held the query: gone with the client, as in the proxy
        gc.collect()
        await asyncio.sleep(0)
        assert not unheard, unheard
        # A waiter that stays still hears the failure.
        with pytest.raises(BootstrapError):
            await cache.engines(endpoint)
    finally:
        loop.set_exception_handler(None)
        for server in cache.servers():
            upstream.close_idle(server)
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()


@pytest.mark.parametrize("status", [408, 429])
def test_an_overloaded_prefill_is_not_called_misconfigured(status):
    result = prefill_outcome(status, b'{"error": {"message": "busy"}}', True)
    assert not result.ok and result.outcome == "error"
    assert "misconfigured" not in result.detail and "overloaded" in result.detail
