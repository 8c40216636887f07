"""The concurrent Mooncake handshake (vLLM 0.16+) end to end, against strict demo backends.

The demo decode pulls the KV of its transfer_id from the engine it was told,
through the KvRegistry it shares with the demo prefill: a wrong engine id, a
missing field or a prefill that never ran makes decode fail or wait, as vLLM
would.
"""

from __future__ import annotations

import asyncio
import json
import re

from helpers import (
    CHAT,
    Daemon,
    chat,
    config_for,
    legs,
    pd_setup,
    request,
    running_proxy,
    tagged_chats,
    wait_until,
)
from lowproxy.demo import DemoBackend, KvRegistry, start_pair
from lowproxy.handshakes import bootstrap

XFER = re.compile(r"^xfer-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


async def test_both_legs_as_the_backends_receive_them():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request(
            "POST", CHAT,
            chat(stream=True, stream_options={"include_usage": True}, min_tokens=2,
                 max_completion_tokens=5,
                 kv_transfer_params={"remote_bootstrap_addr": "http://evil:1",
                                     "remote_engine_id": "evil", "transfer_id": "mine"}),
            headers=[("x-request-id", "req-42"), ("x-data-parallel-rank", "7")])
        assert reply.status == 200, reply.body
        assert reply.complete and reply.body.endswith(b"data: [DONE]\n\n")
        assert b'"usage"' in reply.body  # stream_options reached decode
        [pf], [dc] = legs(prefill, decode)

        transfer_id = pf.body["kv_transfer_params"]["transfer_id"]
        assert XFER.match(transfer_id), transfer_id
        assert pf.body["kv_transfer_params"] == {"do_remote_decode": True,
                                                 "do_remote_prefill": False,
                                                 "transfer_id": transfer_id}
        assert pf.body["stream"] is False and pf.body["max_tokens"] == 1
        assert pf.body["max_completion_tokens"] == 1 and pf.body["ignore_eos"] is True
        for dropped in ("stream_options", "min_tokens"):
            assert dropped not in pf.body
        assert pf.header("x-data-parallel-rank") == b"0"  # the proxy's, not the client's

        assert dc.body["kv_transfer_params"] == {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
            "remote_engine_id": prefill.engine_ids["0"],
            "remote_bootstrap_addr": f"http://127.0.0.1:{prefill.bootstrap_port}"}
        assert dc.body["stream"] is True and dc.body["max_completion_tokens"] == 5
        assert dc.body["stream_options"] == {"include_usage": True} and dc.body["min_tokens"] == 2
        assert dc.header("x-data-parallel-rank") is None

        assert pf.header("x-request-id") == dc.header("x-request-id") == b"req-42"
        assert prefill.bootstrap_queries == 1


async def test_generated_request_id_is_the_same_on_both_legs():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/completions",
                                    {"model": "demo-model", "prompt": "hi", "max_tokens": 3})
        assert reply.status == 200, reply.body
        [pf] = prefill.requests_to("/v1/completions")
        [dc] = decode.requests_to("/v1/completions")
        assert pf.header("x-request-id") and pf.header("x-request-id") == dc.header("x-request-id")


async def test_bootstrap_port_from_the_global_setting_when_the_url_has_none():
    prefill, decode = await start_pair()
    try:
        config = config_for(prefill.url, decode.url, kv_protocol="mooncake",
                            mooncake_bootstrap_port=prefill.bootstrap_port)
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 200, reply.body
            [dc] = decode.requests_to("/chat/completions")
            assert dc.body["kv_transfer_params"]["remote_bootstrap_addr"] == \
                f"http://127.0.0.1:{prefill.bootstrap_port}"
            assert prefill.bootstrap_queries == 1
    finally:
        await prefill.close()
        await decode.close()


async def test_transfer_ids_are_unique_and_shared_by_the_two_legs_of_a_request():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        await tagged_chats(proxy, 8)
        pfs, dcs = legs(prefill, decode)
        by_id = {p.header("x-request-id"): p.body["kv_transfer_params"]["transfer_id"]
                 for p in pfs}
        assert len(set(by_id.values())) == 8
        for dc in dcs:
            assert dc.body["kv_transfer_params"]["transfer_id"] == by_id[dc.header("x-request-id")]
        assert prefill.bootstrap_queries == 1  # cached after the first query


async def test_ranks_are_pinned_and_both_used():
    async with pd_setup("mooncake", ranks=2) as (proxy, prefill, decode):
        for i in range(6):
            reply = await proxy.request("POST", CHAT, chat(), headers=[("x-request-id", f"r{i}")])
            # The demo decode fails when the KV sits on another engine than it was told.
            assert reply.status == 200, reply.body
        pfs, dcs = legs(prefill, decode)
        rank_of = {p.body["kv_transfer_params"]["transfer_id"]:
                   p.header("x-data-parallel-rank").decode() for p in pfs}
        assert set(rank_of.values()) == {"0", "1"}
        assert sorted(rank_of.values()).count("0") == 3  # spread evenly
        for dc in dcs:
            kv = dc.body["kv_transfer_params"]
            assert kv["remote_engine_id"] == prefill.engine_ids[rank_of[kv["transfer_id"]]]


async def test_bootstrap_answer_is_cached_and_queried_again_after_a_failure():
    async with pd_setup("mooncake", ranks=2) as (proxy, prefill, decode):
        for _ in range(3):
            assert (await proxy.request("POST", CHAT, chat())).status == 200
        assert prefill.bootstrap_queries == 1

        prefill.faults.status = 500
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 200, reply.body  # decode recomputed
        prefill.faults.status = None
        prefill.restart_engines()  # a restarted prefill: new engine ids

        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 200, reply.body  # the old ids would make decode fail
        assert prefill.bootstrap_queries == 2
        last = decode.requests_to("/chat/completions")[-1]
        assert last.body["kv_transfer_params"]["remote_engine_id"] in \
            prefill.engine_ids.values()


async def test_bootstrap_down_means_recompute(monkeypatch):
    monkeypatch.setattr(bootstrap, "HOLD_SECONDS", 0.2)
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        prefill.bootstrap_up = False
        reply = await proxy.request("POST", CHAT, chat(kv_transfer_params={"transfer_id": "x"}))
        assert reply.status == 200, reply.body
        assert reply.json()["choices"][0]["message"]["content"]
        pfs, [dc] = legs(prefill, decode)
        assert pfs == []  # no prefill leg without an engine id
        assert "kv_transfer_params" not in dc.body
        assert proxy.proxy.metrics.prefill_legs.get("mooncake", "recompute") == 1

        # The failed query is held, not cached: once the hold is over a request
        # asks again (without waiting for the answer), and the next is served by it.
        prefill.bootstrap_up = True
        assert (await proxy.request("POST", CHAT, chat())).status == 200
        assert prefill.bootstrap_queries == 0  # held: not asked
        await asyncio.sleep(0.25)
        assert (await proxy.request("POST", CHAT, chat())).status == 200
        await wait_until(lambda: prefill.bootstrap_queries == 1, what="asked again")
        await wait_until(lambda: len(proxy.proxy.bootstrap) == 1, what="the map kept")
        assert (await proxy.request("POST", CHAT, chat())).status == 200
        assert "kv_transfer_params" in decode.requests_to("/chat/completions")[-1].body
        assert proxy.proxy.metrics.prefill_legs.get("mooncake", "recompute") == 3


async def test_bootstrap_down_with_error_policy_is_a_502():
    async with pd_setup("mooncake", on_prefill_failure="error") as (proxy, prefill, decode):
        prefill.bootstrap_up = False
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 502
        assert reply.json()["error"]["type"] == "prefill_failed"
        assert legs(prefill, decode) == ([], [])


async def test_bootstrap_query_is_bounded(monkeypatch):
    """A bootstrap server that accepts and never answers is a prefill failure."""
    monkeypatch.setattr(bootstrap, "QUERY_TIMEOUT_SECONDS", 0.3)
    silent: list[asyncio.StreamWriter] = []

    async def never_answer(reader, writer):
        silent.append(writer)
        await reader.read()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    prefill, decode = await start_pair()
    try:
        config = config_for(f"{prefill.url}#bootstrap_port={port}", decode.url,
                            kv_protocol="mooncake")
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 200, reply.body
            assert silent  # the query did reach the silent server
            pfs, [dc] = legs(prefill, decode)
            assert pfs == [] and "kv_transfer_params" not in dc.body
            assert proxy.proxy.metrics.bootstrap_duration.count("error") == 1
    finally:
        for writer in silent:
            writer.close()
        server.close()
        await prefill.close()
        await decode.close()


async def test_failed_prefill_closes_the_held_decode_and_recomputes():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        prefill.faults.status = 500
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 200 and reply.complete, reply.body
        assert reply.body.endswith(b"data: [DONE]\n\n")
        first, second = decode.requests_to("/chat/completions")
        assert "transfer_id" in first.body["kv_transfer_params"]
        assert "kv_transfer_params" not in second.body  # the client's request again
        assert second.body["stream"] is True and second.body["max_tokens"] == 4
        await wait_until(lambda: decode.abandoned == 1, what="decode leg closed")


async def test_hung_prefill_times_out_and_decode_that_waits_forever_is_closed():
    async with pd_setup("mooncake", prefill_timeout=0.5) as (proxy, prefill, decode):
        prefill.faults.hang = True
        decode.kv_wait_timeout = None  # vLLM 0.16-0.28: waits for the KV for ever
        reply = await proxy.request("POST", CHAT, chat(), timeout=10)
        assert reply.status == 200, reply.body
        first, second = decode.requests_to("/chat/completions")
        assert "kv_transfer_params" in first.body and "kv_transfer_params" not in second.body
        await wait_until(lambda: decode.abandoned == 1, what="decode leg closed")
        assert proxy.proxy.metrics.prefill_legs.get("mooncake", "timeout") == 1


async def test_hung_prefill_with_error_policy_is_a_502_and_decode_is_closed():
    async with pd_setup("mooncake", prefill_timeout=0.5,
                        on_prefill_failure="error") as (proxy, prefill, decode):
        prefill.faults.hang = True
        decode.kv_wait_timeout = None
        reply = await proxy.request("POST", CHAT, chat(stream=True), timeout=10)
        assert reply.status == 502
        error = reply.json()["error"]
        assert error["type"] == "prefill_failed" and "0.5" in error["message"]
        assert len(decode.requests_to("/chat/completions")) == 1  # not asked again
        await wait_until(lambda: decode.abandoned == 1, what="decode leg closed")


async def test_prefill_slower_than_decode_still_succeeds():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        decode.stream_chunks = 5
        prefill.faults.delay = 0.6
        pending = asyncio.ensure_future(proxy.request("POST", CHAT, chat(stream=True)))
        await wait_until(lambda: decode.requests_to("/chat/completions"), what="decode leg")
        # Both legs at once: decode was sent while prefill was still working.
        assert proxy.proxy.metrics.prefill_legs.get("mooncake", "ok") == 0
        reply = await pending
        assert reply.status == 200 and reply.complete
        events = [line for line in reply.body.split(b"\n\n") if line.startswith(b"data: {")]
        assert len(events) == 5 and reply.body.endswith(b"data: [DONE]\n\n")
        [dc] = decode.requests_to("/chat/completions")
        assert "transfer_id" in dc.body["kv_transfer_params"]  # no recompute
        assert proxy.proxy.metrics.prefill_legs.get("mooncake", "ok") == 1


async def test_client_going_away_aborts_decode_and_prefill_finishes():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        prefill.faults.delay = 1.0  # the prefill leg is still in flight when the client leaves
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body = json.dumps(chat(stream=True)).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await wait_until(lambda: decode.requests_to("/chat/completions")
                         and prefill.requests_to("/chat/completions"), what="both legs sent")
        writer.close()
        await wait_until(lambda: decode.abandoned == 1, what="decode aborted")
        metrics = proxy.proxy.metrics
        assert metrics.prefill_legs.get("mooncake", "ok") == 0  # prefill still running
        await wait_until(lambda: metrics.prefill_legs.get("mooncake", "ok") == 1,
                         what="prefill leg finished")
        assert prefill.abandoned == 0
        await wait_until(lambda: metrics.requests.get("generation", "499") == 1,
                         what="access record")


async def test_daemon_configured_from_the_environment():
    """PD_PROXY_KV_PROTOCOL, comma lists and #bootstrap_port through the real daemon."""
    registry = KvRegistry()
    prefill = await DemoBackend("prefill", ranks=2, registry=registry).start()
    decodes = [await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
               for _ in range(2)]
    daemon = Daemon(["--port", "0", "--host", "127.0.0.1"], {
        "PD_PROXY_KV_PROTOCOL": "mooncake",
        "PD_PROXY_PREFILL_URL": f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}",
        "PD_PROXY_DECODE_URL": ",".join(d.url for d in decodes)})
    try:
        port = await asyncio.get_running_loop().run_in_executor(None, daemon.wait_listening)
        for _ in range(4):
            reply = await request(port, "POST", CHAT, chat())
            assert reply.status == 200, reply.body
        assert [len(d.requests_to("/chat/completions")) for d in decodes] == [2, 2]
        ranks = {r.header("x-data-parallel-rank") for r in prefill.requests_to("/completions")}
        assert ranks == {b"0", b"1"} and prefill.bootstrap_queries == 1
    finally:
        assert daemon.stop() == 0, daemon.output()
        await prefill.close()
        for decode in decodes:
            await decode.close()


async def test_a_prefill_leg_no_decode_got_is_closed_not_left_to_pin_its_kv():
    """Every decode refused the connection after the prefill leg went out: nothing
    will pull that KV (480 s pinned on a finished Mooncake prefill), so the
    prefill leg is closed and vLLM aborts it."""
    prefill, gone = await start_pair()
    await gone.close()  # its port now refuses connections
    prefill.faults.delay = 1.0
    try:
        config = config_for(f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}",
                            gone.url, kv_protocol="mooncake",
                            mooncake_bootstrap_port=prefill.bootstrap_port)
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat(), timeout=10)
            assert reply.status == 503, reply.body  # no decode backend
            await asyncio.sleep(1.3)  # past the prefill's compute, had it gone on
            assert not prefill.registry._ready  # no KV computed for nobody
            # Closed before it was sent, or while the prefill computed it (aborted).
            assert prefill.abandoned == len(prefill.requests_to(CHAT))
            assert proxy.proxy.metrics.prefill_legs.get("mooncake", "ok") == 0
    finally:
        await prefill.close()


async def test_prefill_legs_left_to_finish_for_clients_gone_are_bounded(monkeypatch):
    """Clients leaving faster than prefills end held a task, a connection and an fd
    each for the prefill timeout, without bound: past MAX_ORPHANED_PREFILLS the leg
    of a request already over is closed (vLLM aborts it)."""
    from helpers import Client
    from lowproxy.proxy import dispatch

    monkeypatch.setattr(dispatch, "MAX_ORPHANED_PREFILLS", 1)
    async with pd_setup("mooncake", prefill_timeout=60) as (proxy, prefill, decode):
        prefill.faults.delay = 1.5
        for n in (1, 2):
            client = await Client.open(proxy.port)
            client.send("POST", CHAT, chat())
            await wait_until(lambda n=n: len(decode.requests_to(CHAT)) == n
                             and len(prefill.requests_to(CHAT)) == n, what="both legs sent")
            client.close()
        await wait_until(lambda: prefill.abandoned == 1, what="the second prefill closed")
        assert proxy.proxy.dispatch.orphans == 1  # the first is left to finish
        await wait_until(lambda: proxy.proxy.metrics.prefill_legs.get("mooncake", "ok") == 1,
                         what="the first prefill finished", timeout=5)
        assert proxy.proxy.dispatch.orphans == 0
