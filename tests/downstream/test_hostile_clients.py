"""What a hostile client can send, over a real socket, and exactly what comes of it.

Client JSON the proxy must not forward (NaN, overflow, nesting it cannot
serialise), fields that would steer the KV pull, request-target forms and
Host values RFC 9112 refuses, headers named in Connection, and bytes meant to
forge log lines (CWE-117).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal

import pytest

from helpers import (
    CHAT,
    Daemon,
    chat,
    config_for,
    parse_replies,
    pd_setup,
    raw_exchange,
    request,
    running_proxy,
)
from lowproxy.demo import start_pair
from lowproxy.handshakes.client_body import (
    PROXY_OWNED_FIELDS,
    without_client_kv,
    without_proxy_owned,
)


def only(raw: bytes):
    replies = parse_replies(raw)
    assert len(replies) == 1, raw
    return replies[0]


def generation_legs(prefill, decode):
    return prefill.requests_to("/chat/completions"), decode.requests_to("/chat/completions")


# -- JSON that is not RFC 8259 JSON, or that the legs could not serialise again

NOT_JSON = {
    "NaN": b'{"model": "m", "temperature": NaN}',
    "Infinity": b'{"model": "m", "temperature": Infinity}',
    "-Infinity": b'{"model": "m", "logit_bias": {"5": -Infinity}}',
    "overflow": b'{"model": "m", "temperature": 1e999}',
    "negative overflow": b'{"model": "m", "temperature": -1e400}',
}


@pytest.mark.parametrize("case", sorted(NOT_JSON))
@pytest.mark.parametrize("path", [CHAT, "/v1/embeddings"])
async def test_non_json_numbers_and_deep_nesting_are_400_never_forwarded(case, path):
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", path, raw_body=NOT_JSON[case])
        assert reply.status == 400, reply.body
        assert reply.json() == {"error": "invalid JSON body"}
        assert not prefill.received and not decode.received


@pytest.mark.parametrize("depth", [129, 500, 900, 990, 100000])
@pytest.mark.parametrize("path", [CHAT, "/v1/embeddings"])
async def test_nesting_the_parser_takes_but_legs_cannot_carry_is_400(depth, path):
    # Up to ~900 levels json.loads succeeds in the proxy's stack but json.dumps,
    # deeper in it, would raise RecursionError (a 500) without the depth bound;
    # deeper still the parser itself gives up.
    body = b'{"model": "m", "x": ' + b"[" * depth + b"]" * depth + b"}"
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", path, raw_body=body)
        assert reply.status == 400, reply.body
        assert reply.json() == {"error": "JSON body nested deeper than 128 levels"}
        assert not prefill.received and not decode.received


async def test_nesting_within_the_bound_and_many_brackets_are_served():
    nested: list = []
    for _ in range(120):
        nested = [nested]
    messages = [{"role": "user", "content": "{[" * 200}] * 50
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(messages=messages, x=nested))
        assert reply.status == 200, reply.body
        [dc] = decode.requests_to("/chat/completions")
        assert dc.body["x"] == nested and dc.body["messages"] == messages


# -- the KV pull belongs to the proxy

HOSTILE_KV = {"remote_host": "evil.example", "remote_bootstrap_addr": "http://evil.example:1",
              "do_remote_prefill": True, "remote_block_ids": [[1]], "transfer_id": "xfer-evil",
              "remote_engine_id": "evil"}
CLIENT_STEERING = {"kv_transfer_params": HOSTILE_KV,
                   "vllm_xargs": {"kv_transfer_params": HOSTILE_KV, "my_flag": 7},
                   "bootstrap_host": "evil.example", "bootstrap_port": 1,
                   "bootstrap_room": 42}


def _no_client_kv(body: dict) -> None:
    assert "evil" not in json.dumps(body), body
    assert body.get("vllm_xargs") == {"my_flag": 7}  # the client's other xargs are kept


def test_proxy_owned_fields_are_dropped_and_the_original_kept():
    body = chat(sampling_params={"extra_args": {"kv_transfer_params": HOSTILE_KV, "k": 1},
                                 "max_tokens": 3}, **CLIENT_STEERING)
    before = json.loads(json.dumps(body))
    stripped = without_proxy_owned(body)
    assert body == before  # nothing the caller holds is changed
    _no_client_kv(stripped)
    assert stripped["sampling_params"] == {"extra_args": {"k": 1}, "max_tokens": 3}
    for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "kv_transfer_params"):
        assert key not in stripped
    assert without_client_kv is without_proxy_owned
    plain = chat()
    assert without_proxy_owned(plain) is plain  # the common case copies nothing
    assert {path[0] for path in PROXY_OWNED_FIELDS} == {
        "kv_transfer_params", "vllm_xargs", "sampling_params", "bootstrap_host",
        "bootstrap_port", "bootstrap_room"}


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_client_kv_fields_reach_no_leg(kv_protocol):
    async with pd_setup(kv_protocol) as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(**CLIENT_STEERING))
        assert reply.status == 200, reply.body
        [pf], [dc] = generation_legs(prefill, decode)
        for leg in (pf, dc):
            _no_client_kv(leg.body)
            assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & set(leg.body)
        # The proxy's own handshake still happened: decode pulled from the real prefill.
        assert dc.body["kv_transfer_params"]["do_remote_prefill"] is True


async def test_client_bootstrap_fields_are_replaced_under_sglang():
    async with pd_setup("sglang") as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(**CLIENT_STEERING))
        assert reply.status == 200, reply.body
        [pf], [dc] = generation_legs(prefill, decode)
        assert pf.body == dc.body
        _no_client_kv(pf.body)
        assert pf.body["bootstrap_host"] == "127.0.0.1"
        assert pf.body["bootstrap_port"] != 1 and pf.body["bootstrap_room"] != 42


async def test_client_kv_fields_dropped_on_recompute_passthrough_and_no_prefill_paths():
    # Bootstrap down: the Mooncake plan falls back to decode alone (recompute).
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        prefill.bootstrap_up = False
        assert (await proxy.request("POST", CHAT, chat(**CLIENT_STEERING))).status == 200
        [dc] = decode.requests_to("/chat/completions")
        _no_client_kv(dc.body)
        assert "bootstrap_room" not in dc.body
        # A passthrough POST.
        body = {"model": "demo-model", "input": "hi", **CLIENT_STEERING}
        assert (await proxy.request("POST", "/v1/embeddings", body)).status == 200
        [embed] = decode.requests_to("/v1/embeddings")
        _no_client_kv(embed.body)
        assert "bootstrap_host" not in embed.body
    # No prefill configured: decode alone, no handshake.
    prefill, decode = await start_pair()
    try:
        async with running_proxy(config_for((), decode.url)) as proxy:
            assert (await proxy.request("POST", CHAT, chat(**CLIENT_STEERING))).status == 200
            [dc] = decode.requests_to("/chat/completions")
            _no_client_kv(dc.body)
            assert "kv_transfer_params" not in dc.body and "bootstrap_port" not in dc.body
    finally:
        await prefill.close()
        await decode.close()


# -- request targets and Host (RFC 9112 3.2)


def _head(method: bytes, target: bytes, host: bytes = b"x", extra: bytes = b"") -> bytes:
    return method + b" " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\n" + extra \
        + b"connection: close\r\n\r\n"


@pytest.mark.parametrize("target, forwarded", [
    (b"http://evil.example/v1/models?limit=1", "/v1/models?limit=1"),
    (b"HTTPS://evil.example:8443/v1/models", "/v1/models"),
    (b"http://evil.example", "/"),
    (b"http://evil.example?x=1", "/?x=1"),
])
async def test_absolute_form_is_reduced_to_origin_form(target, forwarded):
    async with pd_setup() as (proxy, prefill, decode):
        reply = only(await raw_exchange(proxy.port, _head(b"GET", target)))
        assert reply.status in (200, 404), reply
        [received] = decode.received
        assert received.target == forwarded
        for name, value in received.headers:
            assert b"evil" not in value, (name, value)


async def test_absolute_form_generation_reaches_both_legs_as_a_path():
    body = json.dumps(chat()).encode()
    head = (b"POST http://evil.example/v1/chat/completions HTTP/1.1\r\nHost: evil.example\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body))
    async with pd_setup() as (proxy, prefill, decode):
        reply = only(await raw_exchange(proxy.port, head + body))
        assert reply.status == 200, reply
        [pf], [dc] = generation_legs(prefill, decode)
        assert pf.target == dc.target == CHAT
        assert pf.header("host") != b"evil.example" and dc.header("host") != b"evil.example"


BAD_TARGETS = {
    "asterisk for GET": (b"GET", b"*"),
    "asterisk for POST": (b"POST", b"*"),
    "relative path": (b"GET", b"v1/models"),
    "other scheme": (b"GET", b"ftp://evil.example/v1/models"),
    "no authority": (b"GET", b"http:///v1/models"),
    "userinfo": (b"GET", b"http://user:pw@evil.example/v1/models"),
    "fragment": (b"GET", b"http://evil.example/v1/models#x"),
}


@pytest.mark.parametrize("case", sorted(BAD_TARGETS))
async def test_unusable_request_targets_are_400_never_forwarded(case):
    method, target = BAD_TARGETS[case]
    async with pd_setup() as (proxy, prefill, decode):
        reply = only(await raw_exchange(proxy.port, _head(method, target)))
        assert reply.status == 400, (case, reply)
        assert reply.json()["error"]["type"] == "bad_request"
        assert not decode.received and not prefill.received


async def test_asterisk_form_options_is_not_refused():
    async with pd_setup() as (proxy, prefill, decode):
        reply = only(await raw_exchange(proxy.port, _head(b"OPTIONS", b"*")))
        assert reply.status != 400, reply
        assert [r.target for r in decode.received] == ["*"]


@pytest.mark.parametrize("size", [8 * 1024 + 1, 60 * 1024, 200 * 1024])
async def test_request_target_over_the_limit_is_414(size):
    target = b"/v1/models?q=" + b"a" * (size - len(b"/v1/models?q="))
    async with pd_setup() as (proxy, prefill, decode):
        reply = only(await raw_exchange(proxy.port, _head(b"GET", target)))
        assert reply.status == 414, reply
        assert reply.json()["error"]["type"] == "uri_too_long"
        assert not decode.received
        # A target at the limit is served; headers over the limit stay 431.
        ok = only(await raw_exchange(proxy.port, _head(b"GET", target[:8 * 1024])))
        assert ok.status == 200
        big = only(await raw_exchange(proxy.port, _head(b"GET", b"/v1/models",
                                                        extra=b"x-a: %s\r\n" % (b"b" * 70000))))
        assert big.status == 431


@pytest.mark.parametrize("host", [b"a b", b"user@evil.example", b"evil.example/x",
                                  b"h:1:2", b"h:port", b"[zz::1]", b'"h"'])
async def test_invalid_host_is_400(host):
    async with pd_setup() as (proxy, prefill, decode):
        reply = only(await raw_exchange(proxy.port, _head(b"GET", b"/v1/models", host)))
        assert reply.status == 400, (host, reply)
        assert not decode.received


@pytest.mark.parametrize("host", [b"127.0.0.1:8000", b"[::1]:80", b"model-server.local", b""])
async def test_valid_host_values_are_served(host):
    async with pd_setup() as (proxy, prefill, decode):
        reply = only(await raw_exchange(proxy.port, _head(b"GET", b"/v1/models", host)))
        assert reply.status == 200, (host, reply)


async def test_two_host_headers_are_400():
    async with pd_setup() as (proxy, prefill, decode):
        raw = _head(b"GET", b"/v1/models", extra=b"Host: evil.example\r\n")
        reply = only(await raw_exchange(proxy.port, raw))
        assert reply.status == 400 and not decode.received


# -- headers the client's Connection names are hop-by-hop (RFC 9110 7.6.1)


async def test_connection_named_trace_and_request_id_headers_do_not_cross():
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(), headers=[
            ("connection", "keep-alive, traceparent, TraceState, x-request-id"),
            ("traceparent", traceparent), ("tracestate", "evil=1"),
            ("x-request-id", "client-id"), ("user-agent", "ua")])
        assert reply.status == 200, reply.body
        [pf], [dc] = generation_legs(prefill, decode)
        for leg in (pf, dc):
            assert leg.header("traceparent") is None and leg.header("tracestate") is None
            assert leg.header("x-request-id") != b"client-id"
            assert leg.header("user-agent") == b"ua"  # not named: forwarded
        # Not named: the same headers cross as before.
        reply = await proxy.request("GET", "/v1/models", headers=[
            ("traceparent", traceparent), ("x-request-id", "client-id")])
        assert decode.received[-1].header("traceparent") == traceparent.encode()
        assert decode.received[-1].header("x-request-id") == b"client-id"


# -- log lines (CWE-117)

HOSTILE_ID = 'id status=200 "x"\x1b[2J\x9b31m\x7f\x08'
HOSTILE_PATH = '/v1/x"=y%0a\\status=500'
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def _text_fields(line: str) -> dict[str, str]:
    """A text access line's fields: JSON string literals when quoted, else as written."""
    body = line.split("] ", 1)[1]
    pairs = FIELD.findall(body)
    assert " ".join(f"{k}={v}" for k, v in pairs) == body, line  # nothing between fields
    return {key: json.loads(value) if value.startswith('"') else value for key, value in pairs}


async def _hostile_run(log_format: str) -> str:
    prefill, decode = await start_pair()
    daemon = Daemon(["--port", "0", "--host", "127.0.0.1"], env={
        "PD_PROXY_PREFILL_URL": prefill.url, "PD_PROXY_DECODE_URL": decode.url,
        "PD_PROXY_LOG_FORMAT": log_format, "PD_PROXY_LOOP": "asyncio"})
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        hostile = [("x-request-id", HOSTILE_ID.encode("latin-1")),
                   ("traceparent", b"00-\x1b]0;evil\x07 trace_id=forged-b7ad6b7169203331-01"),
                   ("user-agent", b"curl\x1b[31m")]
        reply = await request(port, "GET", HOSTILE_PATH, headers=hostile)
        assert reply.status == 404
        prefill.faults.status = 500  # a warning line carrying the request id as a field
        assert (await request(port, "POST", CHAT, chat(), headers=hostile)).status == 200
    finally:
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0
        await prefill.close()
        await decode.close()
    return daemon.output()


async def test_text_log_lines_escape_client_bytes():
    output = await _hostile_run("text")
    for needle in ("\x1b", "\x9b", "\x7f", "\x08", "\x07"):
        assert needle not in output
    assert all(line.isascii() for line in output.splitlines())
    access = [_text_fields(line) for line in output.splitlines() if "[lowproxy.access]" in line]
    assert len(access) == 2, output
    first = access[0]
    assert first["request_id"] == HOSTILE_ID and first["path"] == HOSTILE_PATH
    assert first["status"] == "404" and first["method"] == "GET"
    assert first["trace_id"] == "\x1b]0;evil\x07 trace_id=forged"
    assert list(first).count("status") == 1
    warnings = [line for line in output.splitlines() if " WARNING " in line]
    assert warnings, output
    assert any(f"request_id={json.dumps(HOSTILE_ID)}" in line for line in warnings), warnings


async def test_json_log_lines_stay_valid_json():
    output = await _hostile_run("json")
    lines = [line for line in output.splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(parsed) == len(lines), output  # every line is one JSON object
    access = [line for line in parsed if line["logger"] == "lowproxy.access"]
    assert access[0]["request_id"] == HOSTILE_ID and access[0]["path"] == HOSTILE_PATH
    assert all(line.isascii() for line in lines)
    assert any(line.get("request_id") == HOSTILE_ID for line in parsed
               if line["level"] == "warning")


# -- a body in one-byte chunks: bounded by pieces, not only bytes


def _chunked_post(body: bytes, chunk: int) -> bytes:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + chunk]), body[i:i + chunk])
                      for i in range(0, len(body), chunk))
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n" + framed + b"0\r\n\r\n")


async def test_a_body_in_too_many_chunks_is_413_and_reaches_no_backend():
    """Each one-byte chunk cost ~170 bytes and h11's time: 32 MiB of them took
    gigabytes; a body may come in max_body_bytes / 256 pieces at most."""
    async with pd_setup(max_body_bytes=64 * 1024) as (proxy, prefill, decode):
        body = json.dumps({"model": "demo-model", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "x" * 400}]}).encode()
        refused = only(await raw_exchange(proxy.port, _chunked_post(body, 1)))
        assert refused.status == 413 and b"too many chunks" in refused.body
        assert generation_legs(prefill, decode) == ([], [])
        fine = only(await raw_exchange(proxy.port, _chunked_post(body, 64)))
        assert fine.status == 200, fine.body  # the same body in fewer pieces


async def test_a_body_of_millions_of_tiny_arrays_is_400_before_it_is_decoded():
    """32 MiB of ``[],`` held the event loop 9 s (decode, depth walk, each leg's
    serialisation); past MAX_CONTAINERS brackets it is refused on a C-speed count."""
    async with pd_setup() as (proxy, prefill, decode):
        body = b'{"model": "demo-model", "messages": [], "x": [' + b"[]," * 600_000 + b"[]]}"
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
        refused = only(await raw_exchange(proxy.port, head + body))
        assert refused.status == 400 and b"arrays and objects" in refused.body
        assert generation_legs(prefill, decode) == ([], [])


def test_a_backend_answer_of_millions_of_arrays_is_a_bad_answer():
    from lowproxy.handshakes.backend_json import BadAnswer, strict_loads
    with pytest.raises(BadAnswer, match="arrays and objects"):
        strict_loads(b'{"kv_transfer_params": [' + b"[]," * 600_000 + b"[]]}", 8 << 20)
    assert strict_loads(b'{"kv_transfer_params": {"remote_block_ids": [[1, 2]]}}', 1 << 20)
