"""SGLang PD end to end: one body to both legs plus the bootstrap fields, both legs at once.

The demo decode waits for the prefill of its bootstrap_room (shared KvRegistry),
so a room that differs between the legs, or a prefill that never runs, shows.
"""

from __future__ import annotations

import asyncio
import json
import logging

from helpers import (
    CHAT,
    ScriptedBackend,
    chat,
    config_for,
    leave_after_both_legs,
    legs,
    pd_setup,
    running_proxy,
    tagged_chats,
    wait_until,
)
from lowproxy.demo import DemoBackend, KvRegistry, start_pair

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


async def test_same_body_to_both_legs_plus_bootstrap_fields():
    prefill, decode = await start_pair()
    try:
        config = config_for(prefill.url, decode.url, kv_protocol="sglang")
        async with running_proxy(config) as proxy:
            client = chat(stream=True, stream_options={"include_usage": True}, min_tokens=2,
                          max_completion_tokens=5, kv_transfer_params={"remote_host": "evil"})
            reply = await proxy.request("POST", CHAT, client, headers=[("x-request-id", "sg-1")])
            assert reply.status == 200 and reply.complete, reply.body
            assert reply.body.endswith(b"data: [DONE]\n\n")
            [pf], [dc] = legs(prefill, decode)
            assert pf.body == dc.body  # the same body, room and rid included
            assert pf.body["rid"].startswith("lowproxy-")  # the proxy's own, fixed width
            room = pf.body["bootstrap_room"]
            assert isinstance(room, int) and 0 <= room < 2 ** 63
            assert pf.body["bootstrap_host"] == "127.0.0.1"
            assert pf.body["bootstrap_port"] == 8998  # PD_PROXY_SGLANG_BOOTSTRAP_PORT default
            # No token capping, no KV fields, nothing the client sent dropped but its KV params.
            expected = {k: v for k, v in client.items() if k != "kv_transfer_params"}
            assert {k: v for k, v in pf.body.items()
                    if k not in (*BOOTSTRAP_FIELDS, "rid")} == expected
            assert pf.header("x-data-parallel-rank") is None
            assert pf.header("x-request-id") == dc.header("x-request-id") == b"sg-1"
            assert prefill.bootstrap_queries == 0  # no Mooncake query for SGLang
    finally:
        await prefill.close()
        await decode.close()


async def test_bootstrap_port_setting_and_per_endpoint_override():
    prefill, decode = await start_pair()
    try:
        config = config_for([f"{prefill.url}#bootstrap_port=9100"], decode.url,
                            kv_protocol="sglang", sglang_bootstrap_port=9000)
        async with running_proxy(config) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 200
        config = config_for([prefill.url], decode.url, kv_protocol="sglang",
                            sglang_bootstrap_port=9000)
        async with running_proxy(config) as proxy:
            assert (await proxy.request("POST", CHAT, chat())).status == 200
        pfs, dcs = legs(prefill, decode)
        assert [p.body["bootstrap_port"] for p in pfs] == [9100, 9000]
        assert [d.body["bootstrap_port"] for d in dcs] == [9100, 9000]
    finally:
        await prefill.close()
        await decode.close()


async def test_rooms_differ_between_requests_and_match_within_one():
    async with pd_setup("sglang") as (proxy, prefill, decode):
        await tagged_chats(proxy, 8)
        pfs, dcs = legs(prefill, decode)
        room_of = {p.header("x-request-id"): p.body["bootstrap_room"] for p in pfs}
        assert len(set(room_of.values())) == 8
        for dc in dcs:
            assert dc.body["bootstrap_room"] == room_of[dc.header("x-request-id")]


async def test_prefill_slower_than_decode_still_succeeds():
    async with pd_setup("sglang") as (proxy, prefill, decode):
        decode.stream_chunks = 5
        prefill.faults.delay = 0.4
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 200 and reply.complete
        assert reply.body.count(b"data: {") == 5 and reply.body.endswith(b"data: [DONE]\n\n")
        [dc] = decode.requests_to("/chat/completions")
        assert "bootstrap_room" in dc.body
        assert proxy.proxy.metrics.prefill_legs.get("sglang", "ok") == 1


async def test_failed_prefill_is_a_502_and_closes_and_aborts_decode():
    """Issue 19: the default recompute policy does not send decode alone under sglang
    (an SGLang decode refuses a leg without a room: it cannot recompute)."""
    async with pd_setup("sglang") as (proxy, prefill, decode):
        prefill.faults.status = 503
        reply = await proxy.request("POST", CHAT, chat(stream=True))
        assert reply.status == 502 and reply.json()["error"]["type"] == "prefill_failed"
        [only] = decode.requests_to("/chat/completions")
        assert "bootstrap_room" in only.body
        # The held decode leg is closed and aborted by the rid both legs carried.
        rid = only.body["rid"]
        assert rid.startswith("lowproxy-") and len(rid) == 41
        await wait_until(lambda: decode.abort_requests == [rid], what="decode leg aborted")
        assert proxy.proxy.metrics.prefill_legs.get("sglang", "recompute") == 0


async def test_hung_prefill_with_decode_waiting_for_ever():
    async with pd_setup("sglang", prefill_timeout=0.5) as (proxy, prefill, decode):
        prefill.faults.hang = True
        decode.kv_wait_timeout = None
        reply = await proxy.request("POST", CHAT, chat(), timeout=10)
        assert reply.status == 502 and reply.json()["error"]["type"] == "prefill_failed"
        assert len(decode.requests_to("/chat/completions")) == 1
        await wait_until(lambda: decode.abandoned == 1, what="decode leg closed")


async def test_hung_prefill_with_error_policy():
    async with pd_setup("sglang", prefill_timeout=0.5,
                        on_prefill_failure="error") as (proxy, prefill, decode):
        prefill.faults.hang = True
        decode.kv_wait_timeout = None
        reply = await proxy.request("POST", CHAT, chat(), timeout=10)
        assert reply.status == 502 and reply.json()["error"]["type"] == "prefill_failed"
        assert len(decode.requests_to("/chat/completions")) == 1
        await wait_until(lambda: decode.abandoned == 1, what="decode leg closed")


class _NoWait(KvRegistry):
    """A decode that does not wait for the KV: it answers before prefill does."""

    async def wait(self, key: str, timeout: float | None) -> str:
        return "anything"


async def _eager_decode_setup(**overrides):
    prefill = await DemoBackend("prefill", sglang_pd=True).start()
    decode = await DemoBackend("decode", registry=_NoWait(), sglang_pd=True).start(
        bootstrap_port=None)
    config = config_for(prefill.url, decode.url, kv_protocol="sglang", **overrides)
    return prefill, decode, config


async def test_decode_answer_is_held_until_prefill_succeeds():
    """Decode's ready 200 is not relayed when prefill then fails: the commit point."""
    prefill, decode, config = await _eager_decode_setup(on_prefill_failure="error")
    try:
        async with running_proxy(config) as proxy:
            prefill.faults.delay = 0.3
            prefill.faults.status = 500
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 502 and reply.json()["error"]["type"] == "prefill_failed"
            [dc] = decode.requests_to("/chat/completions")
            assert "bootstrap_room" in dc.body  # decode had been asked (and answered)
    finally:
        await prefill.close()
        await decode.close()


async def test_held_decode_answer_is_not_replaced_by_a_recompute():
    """Under sglang the default recompute policy answers 502 too (issue 19)."""
    prefill, decode, config = await _eager_decode_setup()
    try:
        async with running_proxy(config) as proxy:
            prefill.faults.delay = 0.3
            prefill.faults.status = 500
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 502, reply.body
            [only] = decode.requests_to("/chat/completions")
            assert "bootstrap_room" in only.body
    finally:
        await prefill.close()
        await decode.close()


async def test_client_going_away_aborts_decode():
    async with pd_setup("sglang") as (proxy, prefill, decode):
        prefill.faults.delay = 0.5
        await leave_after_both_legs(proxy, prefill, decode, chat(stream=True), CHAT)
        [dc], [pf] = decode.requests_to("/chat/completions"), prefill.requests_to(
            "/chat/completions")
        rid = dc.body["rid"]
        # Issue 12: neither leg waits out SGLANG_DISAGGREGATION_WAITING_TIMEOUT: both
        # are aborted by the proxy's own rid, and the prefill connection is not cut.
        await wait_until(lambda: decode.abort_requests == [rid], what="decode aborted")
        await wait_until(lambda: prefill.abort_requests == [rid], what="prefill aborted")
        assert pf.body["rid"] == rid
        assert prefill.abandoned == 0


async def test_vllms_request_model_rules_do_not_refuse_what_sglang_accepts():
    """vLLM's decode-would-reject rules guard a KV that vLLM's shaped prefill leg
    computes for a request its decode refuses; under sglang both legs get the one
    body, and SGLang takes stream_options without stream and prompt_logprobs with it."""
    prefill, decode = await start_pair(sglang_pd=True)
    try:
        config = config_for(prefill.url, decode.url, kv_protocol="sglang")
        async with running_proxy(config) as proxy:
            for extra in ({"stream_options": {"include_usage": True}},
                          {"stream": True, "prompt_logprobs": 1}):
                reply = await proxy.request("POST", CHAT, chat(**extra))
                assert reply.status == 200, (extra, reply.body)
            assert len(prefill.requests_to("/chat/completions")) == 2
    finally:
        await prefill.close()
        await decode.close()


async def test_a_prefill_answer_beyond_8_mib_is_let_go_not_failed():
    """Prompt logprobs of a long prompt make SGLang's prefill answer megabytes; nothing
    of it is read under sglang, so past the 8 MiB kept it is read to its end and let
    go: the request goes on with decode's answer (it was a 502 and an abort)."""
    from lowproxy.handshakes import MAX_PREFILL_ANSWER_BYTES

    big = b'{"text":"x","meta_info":{"input_token_logprobs":[' + \
        b",".join([b'[-0.5,1,null]'] * (MAX_PREFILL_ANSWER_BYTES // 12)) + b"]}}"
    assert len(big) > MAX_PREFILL_ANSWER_BYTES

    async def prefill_answer(request, responder):
        await responder.send_bytes(200, big, [(b"content-type", b"application/json")])

    async def decode_answer(request, responder):
        await responder.send_json(200, {"id": "d", "choices": [{"text": "ok"}]})

    prefill = await ScriptedBackend(prefill_answer).start()
    decode = await ScriptedBackend(decode_answer).start()
    try:
        config = config_for(prefill.url(), decode.url(), kv_protocol="sglang")
        async with running_proxy(config) as proxy:
            for _ in range(2):  # the prefill's connection is still good after one
                reply = await proxy.request("POST", CHAT, chat(), timeout=20)
                assert reply.status == 200 and reply.json()["id"] == "d", reply.body
            assert len(prefill.received) == 2 and prefill.hung_up == 0
    finally:
        await prefill.close()
        await decode.close()


async def test_aborts_carry_the_sglang_admin_key_when_one_is_set(caplog):
    """SGLang with --admin-api-key takes only that key on /abort_request: with
    PD_PROXY_SGLANG_ADMIN_API_KEY set, aborts carry it (and the legs the backend key);
    the key is in no log line."""
    caplog.set_level(logging.DEBUG, logger="lowproxy")
    async with pd_setup("sglang", backend_api_key="sk-backend",
                        sglang_admin_api_key="sk-admin") as (proxy, prefill, decode):
        prefill.faults.status = 503
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 502
        await wait_until(lambda: decode.requests_to("/abort_request"), what="decode aborted")
        [abort] = decode.requests_to("/abort_request")
        assert abort.header("authorization") == b"Bearer sk-admin"
        [leg] = decode.requests_to("/chat/completions")
        assert leg.header("authorization") == b"Bearer sk-backend"
    assert "sk-admin" not in caplog.text
    assert "sk-admin" not in repr(proxy.proxy.config)


PREFILL_LOGPROBS = [[-1.5, 11, None], [-2.5, 12, None]]


def _generate_answer(own: list, text: str = "hi") -> dict:
    return {"text": text, "meta_info": {"id": "x", "input_token_logprobs": own,
                                        "output_token_logprobs": [[-0.1, 5, None]]}}


async def _logprob_pair(stream_events: int = 0):
    async def prefill_answer(request, responder):
        answer = _generate_answer(PREFILL_LOGPROBS, "")
        if json.loads(request.body).get("stream"):
            await responder.start(200, [(b"content-type", b"text/event-stream")])
            await responder.write(b"data: " + json.dumps(answer).encode() + b"\n\n")
            await responder.write(b"data: [DONE]\n\n")
            await responder.end()
        else:
            await responder.send_json(200, answer)

    async def decode_answer(request, responder):
        if json.loads(request.body).get("stream"):
            await responder.start(200, [(b"content-type", b"text/event-stream")])
            for index in range(stream_events):
                event = json.dumps(_generate_answer([], "hi" * (index + 1))).encode()
                await responder.write(b"data: " + event[:9])  # cut across reads
                await asyncio.sleep(0.003)
                await responder.write(event[9:] + b"\n\n")
            await responder.write(b"data: [DONE]\n\n")
            await responder.end()
        else:
            await responder.send_json(200, _generate_answer([[-0.7, 13, None]]))

    return await ScriptedBackend(prefill_answer).start(), \
        await ScriptedBackend(decode_answer).start()


async def test_generate_with_return_logprob_gets_the_prefills_prompt_logprobs():
    """Decode never runs the prompt: as SGLang's mini_lb and model gateway do, the
    prefill's meta_info.input_token_logprobs go in front of decode's, whole and
    streamed (every event); without return_logprob decode's bytes go on untouched."""
    prefill, decode = await _logprob_pair(stream_events=2)
    try:
        config = config_for(prefill.url(), decode.url(), kv_protocol="sglang")
        async with running_proxy(config) as proxy:
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 2},
                    "return_logprob": True, "logprob_start_len": 0}
            whole = await proxy.request("POST", "/generate", body)
            assert whole.status == 200, whole.body
            assert whole.json()["meta_info"]["input_token_logprobs"] == \
                PREFILL_LOGPROBS + [[-0.7, 13, None]]
            streamed = await proxy.request("POST", "/generate", dict(body, stream=True))
            events = [json.loads(line[6:]) for line in streamed.body.split(b"\n\n")
                      if line.startswith(b"data: {")]
            assert len(events) == 2 and streamed.body.endswith(b"data: [DONE]\n\n")
            for event in events:
                assert event["meta_info"]["input_token_logprobs"] == PREFILL_LOGPROBS
            plain = await proxy.request("POST", "/generate", dict(body, return_logprob=False))
            assert plain.json()["meta_info"]["input_token_logprobs"] == [[-0.7, 13, None]]
    finally:
        await prefill.close()
        await decode.close()


def test_the_logprob_merge_leaves_what_it_does_not_understand():
    from lowproxy.handshakes.sglang_logprobs import (
        EncodedPrefix,
        merge_body,
        merge_events,
        prefill_input_logprobs,
        wants_merge,
    )
    from lowproxy.routes import CHAT, SGLANG_GENERATE
    assert wants_merge(SGLANG_GENERATE, {"return_logprob": True})
    assert not wants_merge(CHAT, {"return_logprob": True})
    assert not wants_merge(SGLANG_GENERATE, {})
    assert prefill_input_logprobs(b'[{"meta_info":{"input_token_logprobs":[1]}}]') is None
    assert prefill_input_logprobs(b"not json") is None
    assert prefill_input_logprobs(b'data: {"meta_info":{"input_token_logprobs":[1]}}\n\n'
                                  b"data: [DONE]\n\n") == [1]
    assert merge_body(b'[{"meta_info":{"input_token_logprobs":[]}}]', [1]) is None  # a batch
    assert merge_body(b'{"meta_info":{}}', [1]) is None
    assert merge_body(b'{"meta_info":{"input_token_logprobs":[2]}}', [1]) == \
        b'{"meta_info":{"input_token_logprobs":[1,2]}}'
    one = EncodedPrefix([[-1.5, 1, None]])
    assert merge_events(b"data: [DONE]\n\n", one) == b"data: [DONE]\n\n"
    assert merge_events(b'data: {"meta_info":{"input_token_logprobs":[]}}\n\n', one) == \
        b'data: {"meta_info":{"input_token_logprobs":[[-1.5,1,null]]}}\n\n'
    # Spliced as bytes, or written again where the key is not certain: the same JSON.
    for line in (b'data: {"meta_info":{"input_token_logprobs": [ [-2,2,null] ],"x":1}}',
                 b'data: {"a":{"input_token_logprobs":[]},"meta_info":'
                 b'{"input_token_logprobs":[[-2,2,null]]}}',
                 b'data: {"a":{"input_token_logprobs":[]}}'):
        event = json.loads(line[6:])
        meta = event.get("meta_info")
        if meta is not None:
            meta["input_token_logprobs"] = [[-1.5, 1, None]] + meta["input_token_logprobs"]
        assert json.loads(merge_events(line, one)[6:]) == event, line
    assert merge_events(b'data: {"meta_info":{"input_token_logprobs":[5]}}',
                        EncodedPrefix([])) == b'data: {"meta_info":{"input_token_logprobs":[5]}}'


async def test_a_prefill_answer_of_endless_tiny_chunks_fails_the_leg_soon():
    """The drain past 8 MiB is bounded in chunks too: 1-byte chunks would keep the
    event loop decoding for the whole prefill bound (300 s by default)."""
    async def endless(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        piece = b"1\r\nx\r\n" * 10000
        try:
            while True:
                writer.write(piece)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass

    async def decode_answer(request, responder):
        await responder.send_json(200, {"id": "d", "choices": [{"text": "ok"}]})

    server = await asyncio.start_server(endless, "127.0.0.1", 0)
    decode = await ScriptedBackend(decode_answer).start()
    try:
        port = server.sockets[0].getsockname()[1]
        config = config_for(f"http://127.0.0.1:{port}", decode.url(), prefill_timeout=60)
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat(), timeout=20)
            assert reply.status == 200 and reply.json()["id"] == "d"  # decode recomputed
            legs = proxy.proxy.metrics.prefill_legs
            assert legs.get("relay", "error") == 1 and legs.get("relay", "recompute") == 1
    finally:
        server.close()
        await decode.close()


async def test_responses_prefill_leg_stores_nothing_and_a_stored_conversation_is_400():
    async with pd_setup("sglang") as (proxy, prefill, decode):
        body = {"model": "demo-model", "input": "hello there", "max_output_tokens": 3}
        reply = await proxy.request("POST", "/v1/responses", body)
        assert reply.status == 200, reply.body
        [pf], [dc] = prefill.requests_to("/v1/responses"), decode.requests_to("/v1/responses")
        # SGLang's store keeps every stored response for ever: not the prefill's one token.
        assert pf.body.pop("store") is False and "store" not in dc.body
        assert pf.body == dc.body  # otherwise one body, the one prompt
        assert prefill.stored_responses == {} and list(decode.stored_responses) == [
            reply.json()["id"]]
        # Background may need store: that leg is left as the client sent it.
        await proxy.request("POST", "/v1/responses", {**body, "background": True})
        assert "store" not in prefill.requests_to("/v1/responses")[-1].body
        # Only decode's store holds a conversation; SGLang's prefill would answer 404
        # (a 502 the SDKs retried): 400 before either leg.
        sent = len(prefill.received), len(decode.received)
        for field, value in (("previous_response_id", reply.json()["id"]),
                             ("conversation", "conv_1")):
            refused = await proxy.request("POST", "/v1/responses", {**body, field: value})
            assert refused.status == 400, refused.body
            error = refused.json()["error"]
            assert error["param"] == field and "sglang" in error["message"]
        assert (len(prefill.received), len(decode.received)) == sent
