"""Whatever a backend's JSON looks like: the prefill answer and Mooncake's /query answer.

Unit tests on bytes for backend_json's parsers, then end to end: a Mooncake
bootstrap server that answers hostile JSON (a raw asyncio server written
here) makes a prefill failure under the configured policy, never a 500, and
is never cached: like any failed query it is held for a moment, then asked again.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers import CHAT, RawServer, chat, config_for, running_proxy, wait_until
from lowproxy.demo import start_pair
from lowproxy.handshakes import bootstrap as bootstrap_module
from lowproxy.handshakes.backend_json import (
    MAX_PREFILL_ANSWER_BYTES,
    BadAnswer,
    prefill_answer_kv,
    prefill_kv_params,
    query_engine_ids,
)
from lowproxy.handshakes.bootstrap import BootstrapError, parse_query_answer

NIXL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2], []],
        "remote_engine_id": "e", "remote_host": "10.0.0.5", "remote_port": 5600, "tp_size": 1,
        "odd key \u00e9\n": {"nested": [None, True, 1.5, "\ud800"]}}


# -- the prefill answer


def test_prefill_params_are_returned_verbatim():
    raw = json.dumps({"id": "x", "kv_transfer_params": NIXL}).encode()
    assert prefill_kv_params(raw) == NIXL


@pytest.mark.parametrize("raw", [
    b"[" * 100000,                                    # RecursionError in json
    b'{"kv_transfer_params": ' + b"[" * 500 + b"]" * 500 + b"}",  # parses, nests too deep
    b'{"kv_transfer_params": {"x": NaN}}',
    b'{"kv_transfer_params": {"x": Infinity}}',
    b'{"kv_transfer_params": {"x": -Infinity}}',
    b'{"kv_transfer_params": {"x": 1e999}}',
    b'[{"kv_transfer_params": {"remote_host": "h"}}]',  # not an object
    b'"kv_transfer_params"',
    b"not json",
    b"\xff\xfe{}",
    b"",
])
def test_unusable_prefill_answers_are_bad_answers_and_none(raw):
    with pytest.raises(BadAnswer):
        prefill_answer_kv(raw)
    assert prefill_kv_params(raw) is None


def test_a_huge_prefill_answer_is_refused_before_parsing():
    raw = b'{"kv_transfer_params": {"x": "' + b"a" * MAX_PREFILL_ANSWER_BYTES + b'"}}'
    with pytest.raises(BadAnswer, match="larger than"):
        prefill_answer_kv(raw)
    assert prefill_kv_params(raw) is None


@pytest.mark.parametrize("params", ["null", "[1, 2]", '"x"', "5"])
def test_prefill_params_that_are_not_an_object_are_none(params):
    raw = b'{"kv_transfer_params": %s}' % params.encode()
    assert prefill_answer_kv(raw) is None  # a usable answer without params: no BadAnswer
    assert prefill_kv_params(raw) is None
    assert prefill_kv_params(b'{"choices": []}') is None


# -- the /query answer


def _query(engines: dict) -> bytes:
    return json.dumps({rank: {"engine_id": engine, "worker_addr": {"0": {"0": "tcp://x:1"}}}
                       for rank, engine in engines.items()}).encode()


def test_query_answer_gives_engine_ids_by_rank():
    assert query_engine_ids(_query({"0": "3f2a_dp0", "1": "3f2a_dp1"})) == {
        "0": "3f2a_dp0", "1": "3f2a_dp1"}


@pytest.mark.parametrize("raw", [
    b"[" * 100000,
    b'{"0": {"engine_id": "e", "worker_addr": ' + b"[" * 300 + b"]" * 300 + b"}}",
    b'{"0": {"engine_id": "e", "worker_addr": NaN}}',
    b'[{"engine_id": "e"}]',
    _query({"zero": "e"}),
    _query({"-1": "e"}),
    _query({"1234567": "e"}),
    _query({"\u0663": "e"}),          # an Arabic-Indic digit: isdigit, not a header value
    _query({"0\r\nx-evil: 1": "e"}),
    _query({"0": "e\r\nx-evil: 1"}),
    _query({"0": "e f"}),
    _query({"0": "e\x1b[31m"}),
    _query({"0": "\u00e9"}),
    _query({"0": "e" * 257}),
    json.dumps({str(rank): {"engine_id": "e"} for rank in range(1025)}).encode(),
])
def test_hostile_query_answers_are_refused(raw):
    with pytest.raises(BadAnswer):
        query_engine_ids(raw)
    with pytest.raises(BootstrapError):
        parse_query_answer(raw)


# -- end to end: a bootstrap server that answers what the test says


class RawBootstrap(RawServer):
    """A Mooncake bootstrap server in raw bytes: answers every request with ``body``."""

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self.body = body
        self.queries = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    number: int) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /query "):
            self.queries += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(self.body)
                     + self.body)
        await writer.drain()


HOSTILE_QUERIES = {
    "deep nesting": b"[" * 100000,
    "engine id with CRLF": _query({"0": "e\r\nx-evil: 1"}),
    "rank not decimal": _query({"0; x": "e"}),
    "NaN": b'{"0": {"engine_id": "e", "n": NaN}}',
    "a list": b'[{"engine_id": "e"}]',
}


async def _mooncake_proxy(bootstrap: RawBootstrap, **overrides):
    prefill, decode = await start_pair()
    config = config_for(f"{prefill.url}#bootstrap_port={bootstrap.port}", decode.url,
                        kv_protocol="mooncake", **overrides)
    return prefill, decode, config


@pytest.mark.parametrize("case", sorted(HOSTILE_QUERIES))
async def test_hostile_query_answer_means_recompute_is_held_and_never_cached(case, monkeypatch):
    monkeypatch.setattr(bootstrap_module, "HOLD_SECONDS", 0.2)
    bootstrap = await RawBootstrap(HOSTILE_QUERIES[case]).start()
    prefill, decode, config = await _mooncake_proxy(bootstrap)
    try:
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 200, reply.body  # recompute, never a 500
            assert not prefill.requests_to("/chat/completions")  # no prefill leg sent
            [recomputed] = decode.requests_to("/chat/completions")
            assert "kv_transfer_params" not in recomputed.body
            assert bootstrap.queries == 1 and len(proxy.proxy.bootstrap) == 0
            bootstrap.body = json.dumps({rank: {"engine_id": engine} for rank, engine
                                         in prefill.engine_ids.items()}).encode()
            # Held: the next request recomputes at once, without asking.
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert bootstrap.queries == 1
            # Past the hold a request asks again (in the background) ...
            await asyncio.sleep(0.25)
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            await wait_until(lambda: len(proxy.proxy.bootstrap) == 1, what="the good answer")
            assert bootstrap.queries == 2
            # ... and the good answer is used: the bad one was not cached.
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 200, reply.body
            kv = decode.requests_to("/chat/completions")[-1].body["kv_transfer_params"]
            assert kv["remote_engine_id"] == prefill.engine_ids["0"]
            assert len(prefill.requests_to("/chat/completions")) == 1
            # ... and cached from then on.
            assert (await proxy.request("POST", CHAT, chat())).status == 200
            assert bootstrap.queries == 2
    finally:
        await prefill.close()
        await decode.close()
        await bootstrap.close()


@pytest.mark.parametrize("case", sorted(HOSTILE_QUERIES))
async def test_hostile_query_answer_with_error_policy_is_a_502(case):
    bootstrap = await RawBootstrap(HOSTILE_QUERIES[case]).start()
    prefill, decode, config = await _mooncake_proxy(bootstrap, on_prefill_failure="error")
    try:
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", CHAT, chat())
            assert reply.status == 502, reply.body
            error = reply.json()["error"]
            assert error["type"] == "prefill_failed" and "/query" in error["message"]
            assert "evil" not in error["message"]  # the backend's bytes are not echoed
            assert not decode.received and not prefill.requests_to("/chat/completions")
    finally:
        await prefill.close()
        await decode.close()
        await bootstrap.close()


def test_strict_json_is_the_one_parser_of_client_bodies_and_backend_answers() -> None:
    from lowproxy.handshakes import strict_json

    assert strict_json.loads(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    for bad in (b"NaN", b'{"x": Infinity}', b"[1e999]", b"\xff", b"{"):
        with pytest.raises(strict_json.NotJson):
            strict_json.loads(bad)
    deep = b"[" * (strict_json.MAX_DEPTH + 1) + b"]" * (strict_json.MAX_DEPTH + 1)
    flat = b"[" * strict_json.MAX_DEPTH + b"]" * strict_json.MAX_DEPTH
    assert strict_json.nested_deeper_than(strict_json.loads(flat), strict_json.MAX_DEPTH) is False
    for too_deep in (deep, b"[" * 100000 + b"]" * 100000):
        with pytest.raises(strict_json.TooDeep):
            strict_json.loads(too_deep)


def test_text_of_decodes_as_json_loads_does():
    """The UTF-8 fast path of strict_json.text_of gives json.loads' own text, whatever
    the encoding or the BOM (RFC 8259 8.1 and json.detect_encoding's rules)."""
    import codecs
    import json

    from lowproxy.handshakes.strict_json import text_of

    documents = ['{"a":1}', "{}", "{", '{"é":"\u20ac"}', "[1]", " {}", '"x"', "1"]
    encoded = [document.encode(encoding) for document in documents
               for encoding in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be",
                                "utf-16", "utf-32", "utf-8-sig")]
    encoded += [b"{\x00", b"{\x00\x00\x00", b"{\x00x", codecs.BOM_UTF8 + b"{}", b"\xff\xfe{\x00"]
    for raw in encoded:
        assert text_of(raw) == raw.decode(json.detect_encoding(raw), "surrogatepass"), raw
