"""Stored Responses with several decodes: every follow-up reaches the decode holding it.

vLLM keeps a stored response in the memory of the decode that made it; a
retrieve, a cancel or a ``previous_response_id`` anywhere else is 404. lowproxy
names the response id after its decode (routing/response_homes.py).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator

import pytest

from helpers import config_for, running_proxy
from lowproxy.config import parse_endpoint
from lowproxy.demo import DemoBackend, KvRegistry
from lowproxy.routing.response_homes import (
    ID_LENGTH,
    decode_tag,
    home_of,
    id_for,
    id_in_path,
    placeholder,
)
from lowproxy.upstream.endpoint import Endpoint

RESPONSES = "/v1/responses"


@contextlib.asynccontextmanager
async def two_decodes(kv_protocol: str) -> AsyncIterator[tuple[Any, list[DemoBackend]]]:
    registry = KvRegistry()
    prefill = await DemoBackend("prefill", registry=registry).start()
    decodes = [await DemoBackend("decode", registry=registry).start(bootstrap_port=None)
               for _ in range(2)]
    try:
        config = config_for(prefill.url, [d.url for d in decodes], kv_protocol=kv_protocol,
                            mooncake_bootstrap_port=prefill.bootstrap_port)
        async with running_proxy(config) as running:
            yield running, decodes
    finally:
        for backend in (prefill, *decodes):
            await backend.close()


def response_id(reply: Any, stream: bool) -> str:
    assert reply.status == 200, reply.body
    if not stream:
        return str(reply.json()["id"])
    for line in reply.body.split(b"\n"):
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            assert event["type"] == "response.created"
            return str(event["response"]["id"])
    raise AssertionError(reply.body)


def holder(decodes: list[DemoBackend], rid: str) -> DemoBackend:
    [found] = [d for d in decodes if rid in d.stored_responses]
    return found


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_retrieve_and_previous_response_reach_the_decode_that_stored_it(kv_protocol):
    async with two_decodes(kv_protocol) as (running, decodes):
        made = []
        for n in range(6):
            stream = n % 2 == 1
            reply = await running.request("POST", RESPONSES, {
                "model": "demo-model", "input": f"turn {n}", "max_output_tokens": 3,
                "stream": stream})
            rid = response_id(reply, stream)
            assert len(rid) == ID_LENGTH and rid.startswith("resp_")
            made.append((rid, holder(decodes, rid)))
        assert {id(d) for _, d in made} == {id(d) for d in decodes}  # both decodes serve
        for rid, home in made:
            other = next(d for d in decodes if d is not home)
            for _ in range(3):
                got = await running.request("GET", f"{RESPONSES}/{rid}")
                assert got.status == 200, got.body
                assert got.json()["output"] == home.stored_responses[rid]["output"]
            assert not other.requests_to(f"/responses/{rid}")
            # The next turn names this one: only its decode holds the conversation.
            for _ in range(2):
                follow = await running.request("POST", RESPONSES, {
                    "model": "demo-model", "input": "and then?", "previous_response_id": rid})
                assert follow.status == 200, follow.body
                assert holder(decodes, follow.json()["id"]) is home
            assert not [r for r in other.requests_to(RESPONSES)
                        if r.body.get("previous_response_id") == rid]


async def test_each_decode_leg_gets_an_id_of_its_own_and_a_clients_is_kept():
    async with two_decodes("mooncake") as (running, decodes):
        for _ in range(4):
            reply = await running.request("POST", RESPONSES, {"model": "demo-model",
                                                              "input": "hi"})
            assert reply.status == 200
        sent = [r.body["request_id"] for d in decodes for r in d.requests_to(RESPONSES)]
        assert len(set(sent)) == 4  # fresh randomness per leg, never a placeholder
        for backend in decodes:
            for leg in backend.requests_to(RESPONSES):
                assert leg.body["request_id"].endswith(decode_tag(backend.url))
        own = await running.request("POST", RESPONSES, {"model": "demo-model", "input": "hi",
                                                        "request_id": "resp_mine"})
        assert own.json()["id"] == "resp_mine"  # the client's own id, untouched


def test_ids_name_their_decode_and_nothing_else_does():
    a, b = (Endpoint(parse_endpoint(f"http://127.0.0.1:{port}")) for port in (9100, 9101))
    made = id_for(b)
    assert len(made) == ID_LENGTH == len(placeholder()) and made != id_for(b)
    assert home_of(made, [a, b]) is b and home_of(made, [a]) is None
    for foreign in (None, 7, "resp_" + "0" * 32, made[:-1], "x" + made[1:]):
        assert home_of(foreign, [a, b]) is None, foreign
    assert id_in_path("/v1/responses/resp_1") == "resp_1"
    assert id_in_path("/v1/responses/resp_1/cancel") == "resp_1"
    assert id_in_path("/v1/responses") is None and id_in_path("/v1/responses/") is None
    assert id_in_path("/v1/chat/completions") is None
