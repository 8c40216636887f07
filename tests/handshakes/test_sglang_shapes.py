"""Issue 19 over sockets: under sglang every request shape sends both legs with rooms.

The demo backends run as SGLang PD servers (``sglang_pd``): the decode
refuses a leg without ``bootstrap_room`` as SGLang 0.5.23's scheduler does,
expands a batch into children (``<rid>_<i>``, one room each) and waits for
the prefill of each child's room. A request sent to decode alone, or a batch
with too few rooms, fails there.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from helpers import CHAT, chat, pd_setup, request, wait_until
from lowproxy.demo import start_pair
from lowproxy.demo.sglang import refusal_message

COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
GENERATE = "/generate"
LONG = " ".join(f"word{i}" for i in range(40))

SHAPES: list[tuple[str, str, dict[str, Any], int | None]] = [
    ("chat", CHAT, chat(), None),
    ("chat n=2", CHAT, chat(n=2), 2),
    ("several prompts", COMPLETIONS, {"model": "demo-model", "prompt": ["one", "two", "three"],
                                      "max_tokens": 3}, 3),
    ("token-id lists", COMPLETIONS, {"model": "demo-model", "prompt": [[1, 2, 3], [4, 5]],
                                     "max_tokens": 3}, 2),
    ("one token-id list", COMPLETIONS, {"model": "demo-model", "prompt": [1, 2, 3],
                                        "max_tokens": 3}, None),
    ("echo", COMPLETIONS, {"model": "demo-model", "prompt": "hello", "echo": True,
                           "max_tokens": 3}, None),
    ("prompts and n", COMPLETIONS, {"model": "demo-model", "prompt": ["a", "b"], "n": 2,
                                    "max_tokens": 2}, 4),
    ("beam search", CHAT, chat(use_beam_search=True), None),
    ("responses", RESPONSES, {"model": "demo-model", "input": "hello there",
                              "max_output_tokens": 3}, None),
    ("responses background", RESPONSES, {"model": "demo-model", "input": "hi",
                                         "max_output_tokens": 3, "background": True}, None),
    ("messages", MESSAGES, {"model": "demo-model", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hello"}]}, None),
    ("generate", GENERATE, {"text": "hello there", "sampling_params": {"max_new_tokens": 3}},
     None),
    ("generate batch", GENERATE, {"input_ids": [[1, 2], [3, 4, 5]],
                                  "sampling_params": {"max_new_tokens": 2, "n": 2}}, 4),
]


def only_leg(backend, path):
    [leg] = backend.requests_to(path)
    return leg


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name, path, body, children", SHAPES, ids=[s[0] for s in SHAPES])
async def test_every_shape_sends_both_legs_with_rooms(name, path, body, children, stream):
    # A minimum prompt size decode-only requests would fall under, were they vLLM's.
    async with pd_setup("sglang", min_prefill_prompt_bytes=100_000) as (proxy, prefill,
                                                                         decode):
        client = {**body, "stream": stream}
        reply = await proxy.request("POST", path, client, timeout=10)
        assert reply.status == 200, reply.body
        assert b'"error"' not in reply.body  # a streamed refusal would come as an event
        pf, dc = only_leg(prefill, path), only_leg(decode, path)
        if name == "responses":  # a stored one-token prefill response is kept for ever
            assert pf.body.pop("store") is False and "store" not in dc.body
        assert pf.body == dc.body  # the same body, rooms and rid on both legs
        rooms = dc.body["bootstrap_room"]
        rid = dc.body["rid"]
        if children is None:
            assert isinstance(rooms, int)
        else:
            assert isinstance(rooms, list) and len(set(rooms)) == len(rooms) == children
        assert {k: v for k, v in dc.body.items()
                if k not in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")
                } == client
        assert proxy.proxy.metrics.prefill_legs.get("sglang", "ok") == 1
        assert proxy.proxy.metrics.prefill_legs.get("sglang", "skipped") == 0
        if path == GENERATE and not stream:
            answer = reply.json()
            ids = [a["meta_info"]["id"] for a in answer] if children else \
                [answer["meta_info"]["id"]]
            assert ids == ([f"{rid}_{i}" for i in range(children)] if children else [rid])


@pytest.mark.parametrize("path, body", [
    (CHAT, chat()), (COMPLETIONS, {"prompt": "x", "max_tokens": 2}),
    (RESPONSES, {"input": "x"}), (MESSAGES, {"max_tokens": 2, "messages": []}),
    (GENERATE, {"text": "x"}),
])
async def test_the_demo_decode_refuses_a_leg_without_a_room_as_sglang_does(path, body):
    prefill, decode = await start_pair(sglang_pd=True)
    try:
        refused = await request(decode.port, "POST", path, {**body, "rid": "r-1"})
        assert refused.status == 400
        message = refusal_message("r-1")
        assert message == ("Invalid request: Disaggregated request received without "
                           "bootstrap room id. req.rid='r-1'")
        assert message.encode() in refused.body
        streamed = await request(decode.port, "POST", path,
                                 {**body, "rid": "r-2", "stream": True})
        # Streamed, SGLang has sent its 200 head before the scheduler refuses.
        assert streamed.status == 200
        events = [line for line in streamed.body.split(b"\n\n") if line]
        assert len(events) == 2 and events[-1] == b"data: [DONE]"
        assert refusal_message("r-2") in json.loads(events[0][6:]).__repr__()
        # A leg with a room is served (the prefill of that room is there).
        await request(prefill.port, "POST", path, {**body, "bootstrap_room": 5,
                                                   "bootstrap_host": "127.0.0.1"})
        served = await request(decode.port, "POST", path, {**body, "bootstrap_room": 5,
                                                           "bootstrap_host": "127.0.0.1"})
        assert served.status == 200, served.body
    finally:
        await prefill.close()
        await decode.close()


async def test_the_demo_decode_serves_a_batch_only_with_a_room_per_child():
    prefill, decode = await start_pair(sglang_pd=True, kv_wait_timeout=0.3)
    body = {"model": "demo-model", "prompt": ["a", "b"], "max_tokens": 2,
            "bootstrap_host": "127.0.0.1"}
    try:
        short = await request(decode.port, "POST", COMPLETIONS,
                              {**body, "bootstrap_room": [1]})
        assert short.status == 500  # SGLang indexes past the end of the list
        await request(prefill.port, "POST", COMPLETIONS, {**body, "bootstrap_room": 10})
        # One room is expanded to room + i: 10 and 11 were computed by the prefill.
        ok = await request(decode.port, "POST", COMPLETIONS, {**body, "bootstrap_room": 10})
        assert ok.status == 200, ok.body
        # A room no prefill computed is waited for, then the request fails.
        missing = await request(decode.port, "POST", COMPLETIONS,
                                {**body, "bootstrap_room": [20, 21]})
        assert missing.status == 500
    finally:
        await prefill.close()
        await decode.close()


async def test_a_decode_alone_would_have_been_refused():
    """The strict demo is what makes the shapes test bite: a vLLM plan's decode-only
    leg, sent to it, is the 400 the issue found."""
    async with pd_setup("sglang") as (proxy, prefill, decode):
        body = {"model": "demo-model", "prompt": ["one", "two"], "max_tokens": 2}
        alone = await request(decode.port, "POST", COMPLETIONS, body)
        assert alone.status == 400 and b"without bootstrap room id" in alone.body
        through = await proxy.request("POST", COMPLETIONS, body)
        assert through.status == 200 and len(through.json()["choices"]) == 2
        await wait_until(lambda: len(decode.requests_to(COMPLETIONS)) == 2, what="two legs")
