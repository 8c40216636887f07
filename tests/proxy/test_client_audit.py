"""What an audit of hostile clients found (session 36), each pinned over real sockets.

- Under the sglang handshake an unbounded ``n`` made the proxy draw a room and
  build a rid per sequence before either leg: n = 2**40 wedged the process.
- A body of millions of top-level fields (under the body limit) was copied and
  serialised field by field for each leg, holding the event loop for seconds.
- Under --demo, the demo backends generate in the proxy's process: a client's
  n of a billion took the whole daemon down.
- The demo backends answered wrongly typed fields with a 500 and a traceback.

(An unknown-model flood: tests/routing/test_model_refresh_spacing.py.)
"""

from __future__ import annotations

import time

import pytest

from helpers import CHAT, chat, pd_setup
from lowproxy.handshakes.client_body import MAX_FIELDS
from lowproxy.handshakes.sglang import MAX_CHILDREN


@pytest.mark.parametrize("path, body, param", [
    (CHAT, chat(n=2 ** 40), "n"),
    ("/v1/completions", {"model": "demo-model", "prompt": ["a"] * (MAX_CHILDREN + 1)},
     "prompt"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2 ** 40, "max_new_tokens": 2}},
     "sampling_params.n"),
], ids=["chat n", "completions prompts", "generate n"])
async def test_sglang_requests_past_the_pairing_bound_are_400_before_either_leg(
        path, body, param):
    async with pd_setup("sglang") as (proxy, prefill, decode):
        started = time.monotonic()
        reply = await proxy.request("POST", path, body)
        assert reply.status == 400, reply.body
        assert reply.json()["error"]["param"] == param
        assert time.monotonic() - started < 2  # never a room per sequence
        assert prefill.received == [] and decode.received == []
        # At the bound, the request is paired as before.
        fits = chat(n=4)
        assert (await proxy.request("POST", CHAT, fits)).status == 200


async def test_a_body_of_too_many_fields_is_400_and_reaches_no_backend():
    async with pd_setup() as (proxy, prefill, decode):
        body = chat(**{f"x{i}": 0 for i in range(MAX_FIELDS)})
        reply = await proxy.request("POST", CHAT, body)
        assert reply.status == 400 and "top-level fields" in reply.json()["error"]
        assert prefill.received == [] and decode.received == []
        fits = chat(**{f"x{i}": 0 for i in range(MAX_FIELDS - len(chat()))})
        assert (await proxy.request("POST", CHAT, fits)).status == 200


async def test_the_demo_backend_refuses_a_billion_sequences_and_stays_up():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(n=10 ** 9))
        assert reply.status == 400 and reply.json()["error"]["param"] == "n"
        assert (await proxy.request("POST", CHAT, chat(n=3))).status == 200


@pytest.mark.parametrize("path, body, param", [
    (CHAT, chat(stop_token_ids=5), "stop_token_ids"),
    ("/v1/responses", {"model": "demo-model", "input": "hi", "previous_response_id": ["a"]},
     "previous_response_id"),
])
async def test_the_demo_backend_answers_wrong_types_400_as_vllm_does(path, body, param, caplog):
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", path, body)
        assert reply.status == 400 and reply.json()["error"]["param"] == param, reply.body
    assert not any(record.exc_info for record in caplog.records)  # no traceback logged
