"""Routing, body validation, the no-decode answer and relaying decode's response.

All over 127.0.0.1: the proxy in this process, demo or scripted backends.
"""

from __future__ import annotations

import asyncio
import gzip
import json

import h11
import pytest

from helpers import (
    Client,
    ScriptedBackend,
    chat,
    config_for,
    exchange,
    free_port,
    pd_setup,
    running_proxy,
)
from lowproxy.demo import DemoBackend

NO_DECODE = {"error": {"message": "no available decode backend", "type": "no_decode_backend"}}


# -- local answers


@pytest.mark.parametrize("path", ["/health", "/healthz"])
async def test_health_is_answered_locally(path):
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("GET", path)
        assert reply.status == 200 and reply.json() == {"status": "ok"}
        assert reply.header("content-type") == b"application/json"
        assert prefill.received == [] and decode.received == []


async def test_health_needs_no_backend_at_all():
    async with running_proxy(config_for((), ())) as proxy:
        assert (await proxy.request("GET", "/healthz")).json() == {"status": "ok"}


ADMIN_PATHS = ["/instances/add", "/v1/instances/add", "/any/prefix/instances/add"]


@pytest.mark.parametrize("path", ADMIN_PATHS)
@pytest.mark.parametrize("headers", [[("x-admin-api-key", "k3y")],
                                     [("authorization", "Bearer k3y")],
                                     [("Authorization", "bearer k3y")]])
async def test_admin_with_the_key_is_ok(path, headers):
    async with pd_setup(admin_api_key="k3y") as (proxy, prefill, decode):
        reply = await proxy.request("POST", path, {"instance": "x"}, headers=headers)
        assert reply.status == 200 and reply.json() == {"status": "ok"}
        assert decode.received == [] and prefill.received == []


@pytest.mark.parametrize("key, headers", [
    ("k3y", []),
    ("k3y", [("x-admin-api-key", "wrong")]),
    ("k3y", [("x-admin-api-key", "k3y-longer")]),
    ("k3y", [("authorization", "Bearer wrong")]),
    ("k3y", [("authorization", "Basic k3y")]),
    ("k3y", [("x-admin-api-key", "wrong"), ("authorization", "Bearer k3y")]),
    ("", []),
    ("", [("x-admin-api-key", "")]),
    ("", [("authorization", "Bearer")]),
])
async def test_admin_without_the_right_key_is_forbidden(key, headers):
    async with pd_setup(admin_api_key=key) as (proxy, prefill, decode):
        for path in ADMIN_PATHS:
            reply = await proxy.request("POST", path, {"instance": "x"}, headers=headers)
            assert reply.status == 403 and reply.json() == {"error": "forbidden"}
        assert decode.received == [] and prefill.received == []


async def test_admin_path_is_never_forwarded_whatever_the_method():
    async with pd_setup(admin_api_key="k3y") as (proxy, prefill, decode):
        reply = await proxy.request("GET", "/v1/instances/add",
                                    headers=[("x-admin-api-key", "wrong")])
        assert reply.status == 403
        assert decode.received == []


# -- passthrough


@pytest.mark.parametrize("target", ["/v1/models", "/v1/models?limit=2&after=a%20b&x=%2F",
                                    "/version", "/metrics/custom?x=1", "/v1/x;p=1?q=%E2%9C%93"])
async def test_get_goes_to_decode_with_target_exact(target):
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("GET", target)
        [received] = decode.received
        assert received.method == "GET" and received.target == target
        assert prefill.received == []
        if target.startswith("/v1/models"):
            assert reply.status == 200 and reply.json()["data"][0]["id"] == "demo-model"


async def test_decode_404_passes_through():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("GET", "/nope")
        assert reply.status == 404 and reply.json() == {"detail": "Not Found"}


# /v1/responses is a generation surface since issue 14 (tests/handshakes/test_surfaces.py).
@pytest.mark.parametrize("target", ["/v1/tokenize?add_special_tokens=true&x=%20",
                                    "/v1/completions/extra", "/v1/responses/resp_1/cancel",
                                    "/v1/embeddings?encoding=float", "/v1/rerank",
                                    "/pooling", "/classify", "/score", "/detokenize"])
async def test_non_generation_post_goes_to_decode_only(target):
    async with pd_setup() as (proxy, prefill, decode):
        body = {"model": "demo-model", "prompt": "x", "input": "y", "nested": {"a": [1, None]}}
        reply = await proxy.request("POST", target, body)
        assert reply.status == 200, reply.body
        [received] = decode.received
        assert received.target == target and received.body == body
        assert prefill.received == []


async def test_empty_body_counts_as_an_empty_object():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/tokenize", raw_body=b"")
        assert reply.status == 200
        assert decode.received[0].body == {}
        assert reply.json() == {"path": "/v1/tokenize", "echo": {}}


async def test_empty_body_on_a_generation_path_is_shaped_as_an_empty_object():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/completions", raw_body=b"")
        [pf] = prefill.received
        assert pf.body["max_tokens"] == 1 and pf.body["stream"] is False
        # The demo prefill, like vLLM, rejects a prompt-less request: its 400 is
        # relayed as is, and decode is not asked to fail the same way (issue 12).
        assert decode.received == []
        assert reply.status == 400 and "prompt" in reply.json()["error"]["message"]


# -- body validation


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                  "/v1/tokenize"])
@pytest.mark.parametrize("raw, error", [
    (b"{not json", "invalid JSON body"),
    (b'{"a": 1', "invalid JSON body"),
    (b"\xff\xfe{}", "invalid JSON body"),
    (b"[1, 2]", "JSON body must be an object"),
    (b'"a string"', "JSON body must be an object"),
    (b"42", "JSON body must be an object"),
    (b"null", "JSON body must be an object"),
])
async def test_bad_bodies_are_400_and_cost_nothing_upstream(path, raw, error):
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", path, raw_body=raw)
        assert reply.status == 400
        assert reply.json() == {"error": error}
        assert prefill.received == [] and decode.received == []


async def test_a_multipart_form_is_relayed_as_it_came_to_decode():
    """vLLM's audio APIs take multipart forms; the GCO proxy refused them as bad
    JSON, llm-d's sidecar relays them: relayed, boundary and bytes unchanged. A
    generation route still wants JSON."""
    form = (b"--XyZ\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n"
            b"--XyZ\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"content-type: audio/wav\r\n\r\nRIFF\x00\x01\xff\r\n--XyZ--\r\n")
    content_type = [("content-type", "multipart/form-data; boundary=XyZ")]
    async with pd_setup() as (proxy, prefill, decode):
        await proxy.request("POST", "/v1/audio/transcriptions", raw_body=form,
                            headers=content_type)
        [seen] = decode.received
        assert seen.path == "/v1/audio/transcriptions" and seen.raw_body == form
        assert seen.header("content-type") == b"multipart/form-data; boundary=XyZ"
        assert prefill.received == []
        reply = await proxy.request("POST", "/v1/chat/completions", raw_body=form,
                                    headers=content_type)
        assert reply.status == 400 and reply.json() == {"error": "invalid JSON body"}
        assert len(decode.received) == 1


# -- generation routing


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions",
                                  "/custom/prefix/completions"])
async def test_generation_paths_prime_prefill_on_the_same_path(path):
    async with pd_setup() as (proxy, prefill, decode):
        body = chat() if "chat" in path else {"model": "demo-model", "prompt": "p",
                                                "max_tokens": 2}
        reply = await proxy.request("POST", path + "?q=1", body)
        assert reply.status == 200, reply.body
        [pf], [dc] = prefill.received, decode.received
        assert pf.path == path and dc.path == path
        assert pf.target == path and dc.target == path + "?q=1"  # prefill: no query


async def test_embeddings_go_straight_to_decode():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/embeddings", {"model": "demo-model",
                                                               "input": "x"})
        assert reply.status == 200 and reply.json()["data"][0]["embedding"] == [0.1, 0.2, 0.3]
        assert prefill.received == [] and len(decode.received) == 1


# -- no decode backend


async def test_refused_decode_gets_the_no_decode_answer():
    dead_decode = f"http://127.0.0.1:{free_port()}"
    prefill = await DemoBackend("prefill").start(bootstrap_port=None)
    try:
        async with running_proxy(config_for(prefill.url, dead_decode)) as proxy:
            for path, body in [("/v1/chat/completions", chat()), ("/v1/chat/completions",
                                                                  chat(stream=True)),
                               ("/v1/embeddings", {"input": "x"})]:
                reply = await proxy.request("POST", path, body)
                assert reply.status == 503 and reply.json() == NO_DECODE
                assert reply.header("content-type") == b"application/json"
            reply = await proxy.request("GET", "/v1/models")
            assert reply.status == 503 and reply.json() == NO_DECODE
    finally:
        await prefill.close()


async def test_single_decode_is_tried_again_at_once_after_a_refusal():
    # One decode URL (a Service VIP in the GCO deployment): a refused connection
    # must not turn into seconds of 503s once decode is back.
    port = free_port()
    async with running_proxy(config_for((), f"http://127.0.0.1:{port}")) as proxy:
        assert (await proxy.request("GET", "/v1/models")).status == 503
        decode = await DemoBackend("decode").start(port=port, bootstrap_port=None)
        try:
            reply = await proxy.request("GET", "/v1/models")
            assert reply.status == 200 and len(decode.received) == 1
        finally:
            await decode.close()


async def test_no_decode_configured_gets_the_no_decode_answer():
    async with running_proxy(config_for((), ())) as proxy:
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 503 and reply.json() == NO_DECODE


async def test_custom_no_decode_status_and_message():
    dead_decode = f"http://127.0.0.1:{free_port()}"
    config = config_for((), dead_decode, no_decode_status=429,
                        no_decode_message="décodage indisponible")
    async with running_proxy(config) as proxy:
        reply = await proxy.request("POST", "/v1/completions", {"prompt": "x"})
        assert reply.status == 429
        assert reply.json() == {"error": {"message": "décodage indisponible",
                                          "type": "no_decode_backend"}}


# -- relaying decode's response


async def scripted_proxy(answer, **overrides):
    backend = await ScriptedBackend(answer).start()
    return backend, running_proxy(config_for((), backend.url(), **overrides))


@pytest.mark.parametrize("status", [200, 201, 400, 404, 418, 429, 500, 503])
async def test_decode_status_and_body_bytes_relayed_unchanged(status):
    raw = b'{ "odd" :  "spacing",\n "n": 1.50 }'

    async def answer(request, responder):
        await responder.send_bytes(status, raw, [(b"content-type", b"application/json")])

    backend, proxy_cm = await scripted_proxy(answer)
    try:
        async with proxy_cm as proxy:
            reply = await proxy.request("POST", "/v1/chat/completions", chat())
            assert reply.status == status and reply.body == raw
    finally:
        await backend.close()


async def test_gzip_bytes_are_never_decompressed():
    payload = gzip.compress(json.dumps({"answer": "x" * 2000}).encode())

    async def answer(request, responder):
        if request.method == b"GET":  # chunked: two pieces, no content-length
            await responder.start(200, [(b"content-type", b"application/json"),
                                        (b"content-encoding", b"gzip")])
            await responder.write(payload[:100])
            await responder.write(payload[100:])
            await responder.end()
        else:
            await responder.send_bytes(200, payload, [(b"content-type", b"application/json"),
                                                      (b"content-encoding", b"gzip")])

    backend, proxy_cm = await scripted_proxy(answer)
    try:
        async with proxy_cm as proxy:
            for method, body in [("POST", chat()), ("GET", None)]:
                reply = await proxy.request(method, "/v1/chat/completions", body,
                                            headers=[("accept-encoding", "gzip")])
                assert reply.status == 200 and reply.complete
                assert reply.header("content-encoding") == b"gzip"
                assert reply.body == payload
    finally:
        await backend.close()


@pytest.mark.parametrize("stream, sent, expected", [
    (False, None, b"application/json"),
    (False, b"text/plain; charset=latin-1", b"text/plain; charset=latin-1"),
    (False, b"application/x-ndjson", b"application/x-ndjson"),
    (True, b"text/event-stream; charset=utf-8", b"text/event-stream"),
    (True, None, b"text/event-stream"),
])
async def test_content_type_rules(stream, sent, expected):
    async def answer(request, responder):
        headers = [] if sent is None else [(b"content-type", sent)]
        await responder.send_bytes(200, b"data: x\n\n", headers)

    backend, proxy_cm = await scripted_proxy(answer)
    try:
        async with proxy_cm as proxy:
            reply = await proxy.request("POST", "/v1/completions", {"prompt": "x",
                                                                    "stream": stream})
            assert reply.status == 200 and reply.body == b"data: x\n\n"
            assert reply.header_values("content-type") == [expected]
    finally:
        await backend.close()


@pytest.mark.parametrize("status", [400, 500])
async def test_a_streamed_requests_error_keeps_decodes_json_type(status):
    """Only a stream's success is labelled text/event-stream: labelled so, decode's
    JSON refusal would be an empty stream to SSE clients and unreadable to aiohttp."""
    error = b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}'

    async def answer(request, responder):
        await responder.send_bytes(status, error, [(b"content-type", b"application/json")])

    backend, proxy_cm = await scripted_proxy(answer)
    try:
        async with proxy_cm as proxy:
            reply = await proxy.request("POST", "/v1/completions", {"prompt": "x",
                                                                    "stream": True})
            assert reply.status == status and reply.body == error
            assert reply.header_values("content-type") == [b"application/json"]
    finally:
        await backend.close()


async def test_demo_stream_relayed_as_event_stream():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(stream=True))
        assert reply.header("content-type") == b"text/event-stream"
        events = [line for line in reply.body.split(b"\n\n") if line]
        assert events[-1] == b"data: [DONE]" and len(events) == 5
        assert reply.header("transfer-encoding") == b"chunked"


async def test_decode_body_relayed_chunk_by_chunk():
    release = asyncio.Event()

    async def answer(request, responder):
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        await responder.write(b"data: first\n\n")
        await release.wait()
        await responder.write(b"data: second\n\n")
        await responder.end()

    backend, proxy_cm = await scripted_proxy(answer)
    try:
        async with proxy_cm as proxy:
            client = await Client.open(proxy.port)
            client.send("POST", "/v1/completions", {"prompt": "x", "stream": True})
            assert isinstance(await client.next_event(), h11.Response)
            # The first chunk arrives while decode is still holding back the second.
            first = await client.next_event()
            assert isinstance(first, h11.Data) and bytes(first.data) == b"data: first\n\n"
            release.set()
            second = await client.next_event()
            assert bytes(second.data) == b"data: second\n\n"
            assert isinstance(await client.next_event(), h11.EndOfMessage)
            client.close()
    finally:
        release.set()
        await backend.close()


async def test_decode_breaking_off_mid_stream_cuts_the_client_response():
    async with pd_setup() as (proxy, prefill, decode):
        decode.faults.die_after_chunks = 2
        reply = await proxy.request("POST", "/v1/chat/completions", chat(stream=True))
        assert reply.status == 200
        assert not reply.complete  # never the final chunk: a cut answer must look cut
        assert b"[DONE]" not in reply.body


# -- the client going away


async def test_client_leaving_mid_stream_releases_decode_at_once():
    async with pd_setup() as (proxy, prefill, decode):
        decode.stream_chunks, decode.chunk_delay = 100000, 0.02  # ~30 minutes of tokens
        client = await Client.open(proxy.port)
        client.send("POST", "/v1/chat/completions", chat(stream=True))
        assert isinstance(await client.next_event(), h11.Response)
        assert isinstance(await client.next_event(), h11.Data)
        assert decode.open_streams == 1
        client.close()
        deadline = asyncio.get_running_loop().time() + 5
        while decode.open_streams or not decode.aborted_streams:
            assert asyncio.get_running_loop().time() < deadline, "decode stream still open"
            await asyncio.sleep(0.01)
        assert decode.aborted_streams == 1


async def test_client_leaving_before_the_first_byte_releases_decode():
    started = asyncio.Event()

    async def answer(request, responder):
        started.set()
        await asyncio.Event().wait()  # decode is still computing: no byte yet

    backend = await ScriptedBackend(answer).start()
    prefill = await DemoBackend("prefill").start(bootstrap_port=None)
    try:
        async with running_proxy(config_for(prefill.url, backend.url())) as proxy:
            client = await Client.open(proxy.port)
            client.send("POST", "/v1/chat/completions", chat(stream=True))
            await asyncio.wait_for(started.wait(), 5)
            client.close()
            deadline = asyncio.get_running_loop().time() + 5
            while not backend.hung_up:
                assert asyncio.get_running_loop().time() < deadline, "decode never released"
                await asyncio.sleep(0.01)
            assert backend.hung_up == 1
    finally:
        await backend.close()
        await prefill.close()


# -- connections: keep-alive, pipelining, chunked request bodies


async def test_keep_alive_serves_several_requests_on_one_connection():
    async with pd_setup() as (proxy, prefill, decode):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            for i in range(3):
                reply = await exchange(reader, writer, "POST", "/v1/completions",
                                       {"prompt": "x", "max_tokens": i + 1})
                assert reply.status == 200 and reply.complete
                assert reply.json()["usage"]["completion_tokens"] == i + 1
            reply = await exchange(reader, writer, "GET", "/health")
            assert reply.json() == {"status": "ok"}
        finally:
            writer.close()
        assert len(decode.received) == 3


async def test_pipelined_requests_are_answered_in_order():
    async with pd_setup() as (proxy, prefill, decode):
        decode.chunk_delay = 0.01  # the first answer is the slowest
        bodies = [chat(stream=True, max_tokens=5), None, {"prompt": "p", "max_tokens": 2},
                  {"echo": "me"}]
        requests = [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                    ("POST", "/v1/completions"), ("POST", "/v1/tokenize")]
        wire = b""
        for (method, target), body in zip(requests, bodies, strict=True):
            raw = json.dumps(body).encode() if body is not None else b""
            wire += (f"{method} {target} HTTP/1.1\r\nhost: x\r\n"
                     f"content-length: {len(raw)}\r\n\r\n").encode() + raw
        client = await Client.open(proxy.port)
        client.writer.write(wire)  # all four before any answer
        replies = []
        try:
            for method, _ in requests:
                client.sent_raw(method)
                reply = await client.reply(5)
                replies.append((reply.status, reply.body))
        finally:
            client.close()
        assert [status for status, _ in replies] == [200, 200, 200, 200]
        assert replies[0][1].endswith(b"data: [DONE]\n\n")
        assert json.loads(replies[1][1])["object"] == "list"
        assert json.loads(replies[2][1])["object"] == "text_completion"
        assert json.loads(replies[3][1]) == {"path": "/v1/tokenize", "echo": {"echo": "me"}}


async def test_chunked_request_body_is_read_whole():
    async with pd_setup() as (proxy, prefill, decode):
        raw = json.dumps(chat(max_tokens=2, stop=["x"] * 50)).encode()
        pieces = [raw[:7], raw[7:40], raw[40:]]
        wire = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in pieces:
            wire += b"%x\r\n%s\r\n" % (len(piece), piece)
        wire += b"0\r\n\r\n"
        wire += b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"  # pipelined behind it
        client = await Client.open(proxy.port)
        try:
            for i in range(0, len(wire), 13):  # dribbled in small writes
                client.writer.write(wire[i:i + 13])
                await client.writer.drain()
            client.sent_raw("POST")
            answer = await client.reply(5)
            status, body = answer.status, answer.body
            client.sent_raw("GET")
            health = await client.reply(5)
        finally:
            client.close()
        [dc] = decode.received
        dc.body.pop("kv_transfer_params")
        assert dc.body == chat(max_tokens=2, stop=["x"] * 50)
        assert prefill.received[0].body["max_tokens"] == 1
        assert status == 200 and json.loads(body)["object"] == "chat.completion"
        assert (health.status, health.body) == (200, b'{"status":"ok"}')


# -- pure: routing


@pytest.mark.parametrize("method, path, route", [
    (b"GET", "/health", "health"),
    (b"GET", "/healthz", "health"),
    (b"GET", "/v1/health", "passthrough"),
    (b"POST", "/health", "passthrough"),
    (b"POST", "/instances/add", "admin"),
    (b"GET", "/x/instances/add", "admin"),
    (b"POST", "/v1/chat/completions", "generation"),
    (b"POST", "/v1/completions", "generation"),
    (b"POST", "/completions", "generation"),
    (b"POST", "/v1/embeddings", "passthrough"),
    (b"POST", "/v1/completions/x", "passthrough"),
    (b"GET", "/v1/chat/completions", "passthrough"),
    (b"GET", "/v1/models", "passthrough"),
])
def test_classify(method, path, route):
    from lowproxy.routes import classify

    assert classify(method, path) == route
