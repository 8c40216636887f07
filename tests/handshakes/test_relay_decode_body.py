"""Relay's decode body, the client's prepared while prefill runs (relay.DecodeBodyAfterPrefill),
and Mooncake's recompute fallback cut from its decode body.

Pure: spliced or encoded whole, the bytes are serialise(relay_decode_body(...)),
for small bodies and for those SharedEncoding writes, whatever prefill sent back.
"""

from __future__ import annotations

import json
import random

import pytest
from test_shared_encoding import ODD_VALUES, client_body

from lowproxy.config import parse_endpoint
from lowproxy.handshakes import mooncake, relay
from lowproxy.handshakes.legs import (
    SHARED_ENCODING_MIN_BYTES,
    leg_serialiser,
    relay_decode_body,
    serialise,
)
from lowproxy.handshakes.relay import DecodeBodyAfterPrefill
from lowproxy.upstream.endpoint import Endpoint

PREFILL_PARAMS = [
    {"remote_engine_id": "e", "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.5",
     "remote_port": 7000, "tp_size": 2},
    {"do_remote_decode": True, "do_remote_prefill": False, "remote_request_id": "r-1"},
    None, {}, [], "not an object", 7,
]


def whole(body, params, token_ids=None):
    return serialise(relay_decode_body(body, params, token_ids))


@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize("size", [0, SHARED_ENCODING_MIN_BYTES])
@pytest.mark.parametrize("seed", range(8))
def test_the_decode_body_is_what_encoding_it_whole_writes(seed, size, prepared):
    chooser = random.Random(seed)
    body = client_body(size, chooser)
    for params in PREFILL_PARAMS:
        for token_ids in (None, [1, 2, 3], "not a list"):
            decode = DecodeBodyAfterPrefill(body, leg_serialiser(body, len(serialise(body))))
            if prepared:
                decode.prepare()
                decode.prepare()  # twice: encoded once, same answer
            written = decode(params, token_ids)
            assert json.loads(written) == json.loads(whole(body, params, token_ids))
            if "\ud800 lone" not in body.values():
                assert written == whole(body, params, token_ids)


def test_an_empty_client_body_takes_the_params_alone():
    decode = DecodeBodyAfterPrefill({}, serialise)
    decode.prepare()
    assert decode(PREFILL_PARAMS[0]) == whole({}, PREFILL_PARAMS[0])
    assert decode(None) == b"{}"


def test_params_the_client_also_named_are_prefills_not_a_second_key():
    body = {"model": "m", "kv_transfer_params": {"client": "theirs"}, "prompt": "p"}
    decode = DecodeBodyAfterPrefill(body, serialise)
    decode.prepare()
    written = decode(PREFILL_PARAMS[0])
    assert written == whole(body, PREFILL_PARAMS[0])
    assert written.count(b"kv_transfer_params") == 1
    assert json.loads(written)["kv_transfer_params"]["remote_engine_id"] == "e"


@pytest.mark.parametrize("value", ODD_VALUES)
def test_odd_values_in_prefills_params_are_written_as_json(value):
    body = {"model": "m", "prompt": "caf\u00e9"}
    params = {"remote_engine_id": "e", "odd": value}
    decode = DecodeBodyAfterPrefill(body, serialise)
    decode.prepare()
    assert json.loads(decode(params)) == json.loads(whole(body, params))


def test_once_prepared_the_client_body_is_not_encoded_again():
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    calls = []

    def counting(leg):
        calls.append(leg)
        return serialise(leg)

    decode = DecodeBodyAfterPrefill(body, counting)
    decode.prepare()
    assert len(calls) == 1
    assert decode(PREFILL_PARAMS[0]) == whole(body, PREFILL_PARAMS[0])
    assert decode(None) == serialise(body)
    assert len(calls) == 1  # only prefill's params were encoded after prefill answered


@pytest.mark.parametrize("size", [0, SHARED_ENCODING_MIN_BYTES])
def test_once_prepared_only_the_encoding_is_kept_and_it_is_the_fallback(size):
    """A request waiting for prefill holds the client body's encoding, not the parsed
    body nor the serialiser that shares it; the recompute fallback is that encoding."""
    body = client_body(size, random.Random(3))
    serialiser = leg_serialiser(body, len(serialise(body)))
    decode = DecodeBodyAfterPrefill(body, serialiser)
    assert decode.client_encoded() == serialise(body)  # not prepared: encoded on demand
    decode.prepare()
    assert decode._body is None and decode._serialise is serialise
    assert decode.client_encoded() == serialise(body)
    assert decode(PREFILL_PARAMS[0]) == whole(body, PREFILL_PARAMS[0])


def test_a_body_naming_the_params_itself_is_kept_to_replace_them():
    body = {"model": "m", "kv_transfer_params": {"client": "theirs"}, "prompt": "p"}
    decode = DecodeBodyAfterPrefill(body, serialise)
    decode.prepare()
    assert decode._body is body
    assert decode.client_encoded() == serialise(body)


def test_the_relay_plan_falls_back_to_the_client_body_and_lets_go_once_decode_is_made():
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    plan = relay.plan(body, b"/v1/chat/completions", b"/v1/chat/completions",
                      Endpoint(parse_endpoint("http://127.0.0.1:1")))
    assert plan.client_body is None and plan.fallback is not None
    assert plan.fallback_body() == serialise(body)
    assert plan.prepare_decode is not None
    plan.prepare_decode()
    assert plan.fallback_body() == serialise(body)
    plan.decode_body_made()
    assert (plan.prefill_body, plan.decode_body_for, plan.prepare_decode, plan.fallback) \
        == (b"", None, None, None)


@pytest.mark.parametrize("size", [0, SHARED_ENCODING_MIN_BYTES])
@pytest.mark.parametrize("seed", range(12))
def test_mooncakes_fallback_cut_from_decodes_bytes_is_the_client_body(seed, size):
    """Mooncake keeps no parsed body for its recompute fallback: the client's body is
    decode's bytes before the kv_transfer_params member, as serialise writes it,
    whatever the body holds (its own nested kv_transfer_params keys, strings that
    spell the member, odd values, a lone surrogate)."""
    chooser = random.Random(seed)
    body = client_body(size, chooser)
    body["messages"] = [{"role": "user", "kv_transfer_params": {"x": 1},
                         "content": ',"kv_transfer_params":{"a":"b"}}'}]
    serialiser = leg_serialiser(body, len(serialise(body)))
    plan = mooncake.plan(body, b"/v1/chat/completions", b"/v1/chat/completions",
                         Endpoint(parse_endpoint("http://127.0.0.1:1")), "0", 'engine"0,',
                         "127.0.0.1:8998", "xfer-1", serialise_leg=serialiser)
    assert plan.client_body is None
    assert plan.fallback_body() == serialise(body)
    assert json.loads(plan.decode_body)["kv_transfer_params"]["remote_engine_id"] == 'engine"0,'


def test_mooncakes_fallback_for_an_empty_body_and_bytes_of_another_shape():
    plan = mooncake.plan({}, b"/v1/completions", b"/v1/completions",
                         Endpoint(parse_endpoint("http://127.0.0.1:1")), "0", "e", "h:1", "x")
    assert plan.client_body is None and plan.fallback_body() == b"{}"
    assert mooncake.client_body_in(b'{"model":"m"}') is None
    assert mooncake.client_body_in(b'{"model":{"kv_transfer_params":1}}') is None
