"""The relay handshake's two legs: pure body shaping, then the bodies backends receive.

Prefill failures of every kind (null or missing kv_transfer_params, an error
status, a timeout, an unreachable or untrusted prefill) must leave decode a
body without any kv_transfer_params, the client an ordinary answer, and a log
line for the operator.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest

from helpers import chat, config_for, free_port, pd_setup, running_proxy
from lowproxy.demo import DemoBackend
from lowproxy.handshakes.client_body import BodyError, parse_client_body, without_client_kv
from lowproxy.handshakes.legs import relay_decode_body, relay_prefill_body, serialise

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}


# -- pure: parsing the client's body


@pytest.mark.parametrize("raw, parsed", [(b"", {}), (b"{}", {}), (b' {"a": 1} ', {"a": 1})])
def test_client_body_parses_to_an_object(raw, parsed):
    assert parse_client_body(raw) == parsed


@pytest.mark.parametrize("raw", [b"{", b"nope", b"\xff\xfe", b'{"a":1}x', b'{"a": NaN}',
                                 b'{"a": Infinity}', b'{"a": [-Infinity]}', b'{"a": 1e999}',
                                 b'{"a": -1E+400}'])
def test_invalid_json_is_a_body_error(raw):
    with pytest.raises(BodyError, match="^invalid JSON body$"):
        parse_client_body(raw)


@pytest.mark.parametrize("raw", [b"[" * 100000, b'{"a": ' + b"[" * 128 + b"]" * 128 + b"}",
                                 b'{"a": ' + b'{"b": ' * 200 + b"1" + b"}" * 200 + b"}"])
def test_nesting_deeper_than_the_bound_is_a_body_error(raw):
    with pytest.raises(BodyError, match="^JSON body nested deeper than 128 levels$"):
        parse_client_body(raw)


def test_nesting_at_the_bound_and_huge_finite_numbers_parse():
    raw = b'{"a": ' + b"[" * 127 + b"]" * 127 + b', "b": 1e308, "c": ' + b"9" * 400 + b"}"
    assert parse_client_body(raw)["b"] == 1e308


@pytest.mark.parametrize("raw", [b"[]", b"[1, 2]", b"1", b'"text"', b"null", b"true"])
def test_non_object_json_is_a_body_error(raw):
    with pytest.raises(BodyError, match="^JSON body must be an object$"):
        parse_client_body(raw)


def test_client_kv_transfer_params_are_dropped_without_touching_the_original():
    body = {"model": "m", "kv_transfer_params": {"remote_host": "evil"}}
    assert without_client_kv(body) == {"model": "m"}
    assert body["kv_transfer_params"] == {"remote_host": "evil"}


# -- pure: the prefill leg


def test_prefill_body_caps_and_strips():
    client = chat(stream=True, stream_options={"include_usage": True}, min_tokens=3,
                  min_completion_tokens=2, max_tokens=50, temperature=0.3)
    original = copy.deepcopy(client)
    prefill = relay_prefill_body(client)
    assert prefill["stream"] is False
    assert prefill["max_tokens"] == 1
    assert prefill["ignore_eos"] is True
    assert prefill["kv_transfer_params"] == PREFILL_KV
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in prefill
    assert "max_completion_tokens" not in prefill  # only capped when the client sent it
    assert prefill["temperature"] == 0.3 and prefill["messages"] == client["messages"]
    assert client == original  # the client's body is never modified


def test_prefill_body_caps_max_completion_tokens_when_sent():
    prefill = relay_prefill_body(chat(max_completion_tokens=77))
    assert prefill["max_completion_tokens"] == 1 and prefill["max_tokens"] == 1


def test_prefill_body_sets_stream_false_even_when_absent():
    prefill = relay_prefill_body({"prompt": "x"})
    assert prefill == {"prompt": "x", "stream": False, "max_tokens": 1, "ignore_eos": True,
                       "kv_transfer_params": PREFILL_KV}


def test_prefill_body_overrides_client_ignore_eos_and_kv():
    prefill = relay_prefill_body({"prompt": "x", "ignore_eos": False,
                                  "kv_transfer_params": {"remote_host": "evil"}})
    assert prefill["ignore_eos"] is True
    assert prefill["kv_transfer_params"] == PREFILL_KV


# -- pure: the decode leg


def test_decode_body_relays_prefill_kv_with_flags_turned_round():
    client = chat(stream=True, min_tokens=2)
    prefill_kv = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_block_ids": [4, 5], "remote_engine_id": "e1", "custom": {"x": 1}}
    decode = relay_decode_body(client, prefill_kv)
    assert decode["kv_transfer_params"] == {
        "do_remote_decode": False, "do_remote_prefill": True,
        "remote_block_ids": [4, 5], "remote_engine_id": "e1", "custom": {"x": 1}}
    assert {k: v for k, v in decode.items() if k != "kv_transfer_params"} == client
    assert "kv_transfer_params" not in client
    assert prefill_kv["do_remote_prefill"] is False  # prefill's answer is not mutated


@pytest.mark.parametrize("prefill_kv", [None, {}, [], "text", 0, ["remote_block_ids"]])
def test_decode_body_without_usable_prefill_kv_has_no_kv_at_all(prefill_kv):
    client = chat(stream=True)
    decode = relay_decode_body(client, prefill_kv)
    assert decode == client and "kv_transfer_params" not in decode


def test_serialise_is_compact_json_that_round_trips():
    body = {"a": "\u00e9\ud800", "b": [1, 2.5, None]}
    raw = serialise(body)
    assert json.loads(raw) == body and b" " not in raw


# -- over sockets: the bodies backends receive


def kv_free(body):
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


async def test_both_legs_as_received_completions_path():
    async with pd_setup() as (proxy, prefill, decode):
        client = {"model": "demo-model", "prompt": "hi", "max_tokens": 3,
                  "min_tokens": 1, "kv_transfer_params": {"remote_host": "attacker"}}
        reply = await proxy.request("POST", "/v1/completions?tag=1", client)
        assert reply.status == 200, reply.body
        [pf] = prefill.received
        [dc] = decode.received
        assert pf.target == "/v1/completions" and dc.target == "/v1/completions?tag=1"
        assert pf.body == {"model": "demo-model", "prompt": "hi", "max_tokens": 1,
                           "stream": False, "ignore_eos": True,
                           "kv_transfer_params": PREFILL_KV}
        # Decode: the client's body minus its kv_transfer_params, plus prefill's.
        assert kv_free(dc.body) == kv_free(client)
        assert dc.body["kv_transfer_params"]["remote_host"] == "127.0.0.1"
        assert dc.body["kv_transfer_params"]["do_remote_prefill"] is True
        assert dc.body["kv_transfer_params"]["do_remote_decode"] is False
        assert reply.json()["choices"][0]["text"] == "tok0 tok1 tok2 "


async def test_prefill_runs_before_decode():
    async with pd_setup() as (proxy, prefill, decode):
        order = []
        original_prefill, original_decode = prefill.handle, decode.handle

        async def prefill_seen(request, responder):
            order.append("prefill")
            await original_prefill(request, responder)

        async def decode_seen(request, responder):
            order.append("decode")
            await original_decode(request, responder)

        prefill.server.handler, decode.server.handler = prefill_seen, decode_seen
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
        assert order == ["prefill", "decode"]


async def test_prefill_custom_kv_fields_reach_decode_unchanged():
    async with pd_setup() as (proxy, prefill, decode):
        prefill.faults.kv_params = {"remote_block_ids": [9], "remote_request_id": "r",
                                    "nested": {"deep": [1, {"x": None}]}, "tp_size": 4}
        # The demo decode checks the transfer really happened; this one never did,
        # so only the body decode received is asserted.
        await proxy.request("POST", "/v1/chat/completions", chat())
        [dc] = decode.received
        assert dc.body["kv_transfer_params"] == {
            "remote_block_ids": [9], "remote_request_id": "r",
            "nested": {"deep": [1, {"x": None}]}, "tp_size": 4,
            "do_remote_prefill": True, "do_remote_decode": False}


@pytest.mark.parametrize("kv_params", [None, {}, "not-a-dict"])
async def test_prefill_returning_no_kv_leaves_decode_without_kv(kv_params):
    async with pd_setup() as (proxy, prefill, decode):
        prefill.faults.kv_params = kv_params
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 200, reply.body
        [dc] = decode.received
        assert "kv_transfer_params" not in dc.body
        assert dc.body == chat()


async def test_prefill_answer_without_the_key_leaves_decode_without_kv():
    prefill_answer = {"id": "x", "choices": []}  # no kv_transfer_params key at all

    async def answer(request, responder):
        await responder.send_json(200, prefill_answer)

    from helpers import ScriptedBackend

    prefill = await ScriptedBackend(answer).start()
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    try:
        async with running_proxy(config_for(prefill.url(), decode.url)) as proxy:
            reply = await proxy.request("POST", "/v1/chat/completions", chat())
            assert reply.status == 200
            assert len(prefill.received) == 1
            [dc] = decode.received
            assert "kv_transfer_params" not in dc.body
    finally:
        await prefill.close()
        await decode.close()


def prefill_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "prefill" in r.getMessage()]


@pytest.mark.parametrize("status", [401, 404, 500, 503])
async def test_prefill_error_status_is_logged_and_hidden(status, caplog):
    caplog.set_level(logging.WARNING, logger="lowproxy")
    async with pd_setup() as (proxy, prefill, decode):
        prefill.faults.status = status
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 200
        assert b"injected failure" not in reply.body and b"prefill" not in reply.body
        assert reply.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "
        [dc] = decode.received
        assert "kv_transfer_params" not in dc.body
        assert any(str(status) in m for m in prefill_warnings(caplog)), caplog.text


async def test_prefill_timeout_is_logged_and_hidden(caplog):
    caplog.set_level(logging.WARNING, logger="lowproxy")
    async with pd_setup(prefill_timeout=0.3) as (proxy, prefill, decode):
        prefill.faults.hang = True
        reply = await proxy.request("POST", "/v1/chat/completions", chat(stream=True))
        assert reply.status == 200 and reply.complete
        assert reply.body.endswith(b"data: [DONE]\n\n")
        [dc] = decode.received
        assert "kv_transfer_params" not in dc.body and dc.body["stream"] is True
        assert any("timeout" in m for m in prefill_warnings(caplog)), caplog.text


async def test_prefill_unreachable_is_logged_and_hidden(caplog):
    caplog.set_level(logging.WARNING, logger="lowproxy")
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        async with running_proxy(config_for(dead, decode.url)) as proxy:
            reply = await proxy.request("POST", "/v1/chat/completions", chat())
            assert reply.status == 200
            assert b"refused" not in reply.body.lower()
            [dc] = decode.received
            assert "kv_transfer_params" not in dc.body
            assert prefill_warnings(caplog), caplog.text
    finally:
        await decode.close()


async def test_prefill_closing_without_answer_is_hidden():
    async with pd_setup() as (proxy, prefill, decode):
        prefill.faults.close_without_response = True
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 200
        [dc] = decode.received
        assert "kv_transfer_params" not in dc.body


async def test_without_prefill_configured_decode_gets_the_client_body():
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    try:
        async with running_proxy(config_for((), decode.url)) as proxy:
            body = chat(kv_transfer_params={"remote_host": "evil"}, min_tokens=1)
            reply = await proxy.request("POST", "/v1/chat/completions", body)
            assert reply.status == 200
            [dc] = decode.received
            assert dc.body == kv_free(body)
    finally:
        await decode.close()


async def test_embeddings_skip_prefill_and_drop_client_kv():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/embeddings",
                                    {"model": "demo-model", "input": "x",
                                     "kv_transfer_params": {"remote_host": "evil"}})
        assert reply.status == 200 and reply.json()["object"] == "list"
        assert prefill.received == []
        [dc] = decode.received
        assert dc.body == {"model": "demo-model", "input": "x"}

