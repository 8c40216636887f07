"""Issue 14: every generation API disaggregated, and usage that bills right.

Against the demo backends in vLLM 0.33's shapes: the Responses API (through
the openai SDK too), the Anthropic Messages API (a raw client), vLLM's
generate API; the prefill's cached-token figure in decode's usage, streamed
and not; the opt-in prompt token forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from helpers import chat, config_for, running_proxy
from lowproxy.demo import start_pair
from lowproxy.handshakes.usage import (
    cached_tokens_of,
    prompt_tokens_of,
    rewrite_body,
    rewrite_events,
)
from lowproxy.routes import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    GENERATION,
    MESSAGES,
    PASSTHROUGH,
    RESPONSES,
    classify,
    route_and_surface,
    surface_of,
)

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
GENERATE_PATH = "/inference/v1/generate"
LONG = " ".join(f"word{i}" for i in range(40))  # 40 tokens: two cacheable blocks


@contextlib.asynccontextmanager
async def cluster(kv_protocol: str = "mooncake", **overrides: Any):
    prefill, decode = await start_pair(prompt_tokens_details=True, scale_out=True,
                                       sglang_pd=kv_protocol == "sglang")
    config = config_for(f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}", decode.url,
                        kv_protocol=kv_protocol, **overrides)
    try:
        async with running_proxy(config) as proxy:
            yield proxy, prefill, decode
    finally:
        await prefill.close()
        await decode.close()


def responses_body(**extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "input": "hello there", "max_output_tokens": 4, **extra}


def messages_body(**extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "max_tokens": 4, "stop_sequences": ["END"],
            "messages": [{"role": "user", "content": "hello there"}], **extra}


def generate_body(**extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "token_ids": [1, 2, 3, 4],
            "sampling_params": {"max_tokens": 4, "min_tokens": 2, "stop_token_ids": [9]},
            **extra}


# -- the route table


@pytest.mark.parametrize("path, surface", [
    ("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETIONS),
    ("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES),
    ("/inference/v1/generate", GENERATE), ("/inference/ep/v1/responses", RESPONSES),
    ("/v1/embeddings", None), ("/v1/rerank", None), ("/tokenize", None),
    ("/v1/responses/resp_1", None),
])
def test_route_table_matches_by_suffix(path, surface):
    assert surface_of(path) == surface
    assert (classify(b"POST", path) == "generation") == (surface is not None)


# -- each surface under each handshake


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_responses_legs(kv_protocol):
    async with cluster(kv_protocol) as (proxy, prefill, decode):
        client = responses_body(stop_token_ids=[5], store=True)
        reply = await proxy.request("POST", RESPONSES_PATH, client)
        assert reply.status == 200, reply.body
        assert reply.json()["object"] == "response"
        [pf], [dc] = prefill.requests_to(RESPONSES_PATH), decode.requests_to(RESPONSES_PATH)
        assert pf.body["max_output_tokens"] == 1 and pf.body["stream"] is False
        assert pf.body["store"] is False and pf.body["ignore_eos"] is True
        assert "stop_token_ids" not in pf.body
        assert pf.body["kv_transfer_params"]["do_remote_decode"] is True
        kv = dc.body.pop("kv_transfer_params")
        assert kv["do_remote_prefill"] is True
        assert dc.body == client  # the client's body plus the handshake's params


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_messages_legs_and_stream_relayed_unchanged(kv_protocol):
    async with cluster(kv_protocol, rewrite_cached_tokens=False) as (proxy, prefill, decode):
        reply = await proxy.request("POST", MESSAGES_PATH, messages_body(stream=True))
        assert reply.status == 200, reply.body
        assert reply.header("content-type").startswith(b"text/event-stream")
        text = reply.body.decode()
        assert text.startswith("event: message_start\ndata: ")
        assert "event: message_delta" in text and text.rstrip().endswith("}")
        [pf] = prefill.requests_to(MESSAGES_PATH)
        assert pf.body["max_tokens"] == 1 and pf.body["stream"] is False
        assert "stop_sequences" not in pf.body and "ignore_eos" not in pf.body
        [dc] = decode.requests_to(MESSAGES_PATH)
        assert dc.body["stop_sequences"] == ["END"] and dc.body["stream"] is True


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_generate_shapes_inside_sampling_params(kv_protocol):
    async with cluster(kv_protocol) as (proxy, prefill, decode):
        client = generate_body()
        reply = await proxy.request("POST", GENERATE_PATH, client)
        assert reply.status == 200, reply.body
        assert len(reply.json()["choices"][0]["token_ids"]) == 4
        [pf], [dc] = prefill.requests_to(GENERATE_PATH), decode.requests_to(GENERATE_PATH)
        params = pf.body["sampling_params"]
        assert params["max_tokens"] == 1 and params["ignore_eos"] is True
        assert "min_tokens" not in params and "stop_token_ids" not in params
        assert dc.body["sampling_params"] == client["sampling_params"]  # unchanged


@pytest.mark.parametrize("path, body, reason", [
    (RESPONSES_PATH, responses_body(previous_response_id="resp_1"), "stored-conversation"),
    (RESPONSES_PATH, responses_body(conversation="conv_1"), "stored-conversation"),
    (RESPONSES_PATH, responses_body(background=True), "background"),
    (GENERATE_PATH, {"model": "demo-model", "token_ids": [1]}, "no-sampling-params"),
])
async def test_requests_only_decode_can_serve_go_there_alone(path, body, reason):
    async with cluster("mooncake") as (proxy, prefill, decode):
        await proxy.request("POST", path, body)
        assert prefill.requests_to(path) == []
        [dc] = decode.requests_to(path)
        assert dc.body == body
        assert proxy.proxy.metrics.prefill_legs.get("mooncake", "skipped", reason) == 1


async def test_sglang_splits_the_other_surfaces_too():
    """Issue 19: an SGLang decode refuses a leg without a room, Messages included."""
    async with cluster("sglang") as (proxy, prefill, decode):
        reply = await proxy.request("POST", MESSAGES_PATH, messages_body())
        assert reply.status == 200, reply.body
        [pf], [dc] = prefill.requests_to(MESSAGES_PATH), decode.requests_to(MESSAGES_PATH)
        assert pf.body == dc.body and isinstance(dc.body["bootstrap_room"], int)


async def test_openai_sdk_responses_create_and_stream():
    openai = pytest.importorskip("openai", reason="the OpenAI client is in the test extra only")
    async with cluster("mooncake") as (proxy, prefill, decode):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1",
                                    api_key="unused", max_retries=0)
        try:
            response = await client.responses.create(model="demo-model", input="hi",
                                                     max_output_tokens=3)
            assert response.output_text == "tok0 tok1 tok2 "
            events = [event.type async for event in await client.responses.create(
                model="demo-model", input="hi", max_output_tokens=3, stream=True)]
        finally:
            await client.close()
        # The cap is reached: vLLM ends such a stream with response.incomplete.
        assert events[0] == "response.created"
        assert events[-1] in ("response.completed", "response.incomplete")
        assert len(prefill.requests_to(RESPONSES_PATH)) == 2


# -- usage that bills right


@pytest.mark.parametrize("surface, raw, cached", [
    (CHAT, {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}, 8),
    (CHAT, {"usage": {"prompt_tokens": 9, "prompt_tokens_details": None}}, None),
    (RESPONSES, {"usage": {"input_tokens_details": {"cached_tokens": 0}}}, 0),
    (MESSAGES, {"usage": {"input_tokens": 3, "cache_read_input_tokens": 16}}, 16),
    (MESSAGES, {"usage": {"input_tokens": 3, "cache_read_input_tokens": None}}, None),
    (CHAT, {"usage": "x"}, None), (GENERATE, {"usage": {}}, None),
])
def test_the_prefill_figure_is_read_per_surface(surface, raw, cached):
    assert cached_tokens_of(surface, raw) == cached


def test_messages_input_tokens_still_add_up_to_the_prompt():
    raw = json.dumps({"usage": {"input_tokens": 4, "cache_read_input_tokens": 36,
                                "cache_creation_input_tokens": 0, "output_tokens": 2}})
    usage = json.loads(rewrite_body(MESSAGES, raw.encode(), 16))["usage"]
    assert usage["cache_read_input_tokens"] == 16 and usage["input_tokens"] == 24


def test_events_without_usage_pass_untouched_and_the_usage_event_is_rewritten():
    plain = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    assert rewrite_events(CHAT, plain, 5) is plain
    last = (b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
            b'"prompt_tokens_details":{"cached_tokens":40}}}\n\ndata: [DONE]\n\n')
    out = rewrite_events(CHAT, last, 32)
    assert out.endswith(b"\n\ndata: [DONE]\n\n")
    event = json.loads(out.split(b"\n")[0][6:])
    assert event["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


async def _cached(proxy, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """(non-streamed usage, streamed usage event) for one request shape, sent twice."""
    reply = await proxy.request("POST", path, body)
    assert reply.status == 200, reply.body
    streamed = await proxy.request("POST", path, dict(body, stream=True,
                                                      **({"stream_options": {
                                                          "include_usage": True}}
                                                         if path.endswith("completions")
                                                         else {})))
    assert streamed.status == 200 and streamed.complete
    return reply.json()["usage"], streamed.body


@pytest.mark.parametrize("rewrite", [True, False])
async def test_chat_usage_reports_the_prefill_figure(rewrite):
    async with cluster("mooncake", rewrite_cached_tokens=rewrite) as (proxy, prefill, decode):
        body = {"model": "demo-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": LONG}]}
        usage, streamed = await _cached(proxy, "/v1/chat/completions", body)
        prompt = usage["prompt_tokens"]
        # The Mooncake decode reports the pulled prompt as cached; the prefill's
        # prefix cache was cold for the first request.
        expected = 0 if rewrite else prompt
        assert usage["prompt_tokens_details"]["cached_tokens"] == expected
        # The streamed request found the prefill's prefix cache warm: whole blocks.
        [last] = [json.loads(line[6:]) for line in streamed.split(b"\n")
                  if line.startswith(b"data: {") and b'"usage":{' in line]
        warm = last["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert warm == (32 if rewrite else prompt)


@pytest.mark.parametrize("surface, raw, prompt", [
    (CHAT, {"usage": {"prompt_tokens": 9}}, 9),
    (RESPONSES, {"usage": {"input_tokens": 7}}, 7),
    # Anthropic's input_tokens leaves out the cached and the cache-creation parts.
    (MESSAGES, {"usage": {"input_tokens": 3, "cache_read_input_tokens": 16,
                          "cache_creation_input_tokens": 2}}, 21),
    (MESSAGES, {"usage": {"input_tokens": 3, "cache_read_input_tokens": "x"}}, None),
    (CHAT, {"usage": {"prompt_tokens": True}}, None), (GENERATE, {"usage": {}}, None),
])
def test_the_prefill_prompt_size_is_read_per_surface(surface, raw, prompt):
    assert prompt_tokens_of(surface, raw) == prompt


async def test_prefix_cache_counters_sum_the_prefill_figures():
    """lowproxy_prefill_{prompt,cached}_tokens_total: the dashboard's hit rate."""
    async with cluster("mooncake") as (proxy, prefill, decode):
        body = {"model": "demo-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": LONG}]}
        usages = [(await proxy.request("POST", "/v1/chat/completions", body)).json()["usage"]
                  for _ in range(3)]
        metrics = proxy.proxy.metrics
        prompt = sum(usage["prompt_tokens"] for usage in usages)
        cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in usages)
        assert cached == 64  # cold, then two whole blocks twice
        assert metrics.prefill_prompt_tokens.get("mooncake") == prompt
        assert metrics.prefill_cached_tokens.get("mooncake") == cached


async def test_responses_and_messages_usage_report_the_prefill_figure():
    async with cluster("mooncake") as (proxy, prefill, decode):
        usage, streamed = await _cached(proxy, RESPONSES_PATH, responses_body(input=LONG))
        assert usage["input_tokens_details"]["cached_tokens"] == 0
        completed = [json.loads(line[6:]) for line in streamed.split(b"\n")
                     if line.startswith(b"data: ") and (b"response.completed" in line
                                                        or b"response.incomplete" in line)]
        assert completed[0]["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 32
        other = " ".join(f"other{i}" for i in range(40))  # a prefix the cache has not seen
        body = messages_body(messages=[{"role": "user", "content": other}])
        usage, streamed = await _cached(proxy, MESSAGES_PATH, body)
        total = usage["input_tokens"] + usage["cache_read_input_tokens"]
        assert usage["cache_read_input_tokens"] == 0 and total > 40
        start = [json.loads(line[6:]) for line in streamed.split(b"\n")
                 if line.startswith(b"data: ") and b"message_start" in line][0]
        assert start["message"]["usage"]["cache_read_input_tokens"] == 32


async def test_recomputed_requests_report_decode_s_own_figure():
    async with cluster("mooncake") as (proxy, prefill, decode):
        prefill.faults.status = 503
        body = {"model": "demo-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": LONG}]}
        reply = await proxy.request("POST", "/v1/chat/completions", body)
        assert reply.status == 200
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- tokenize once (opt-in)


@pytest.mark.parametrize("forward", [True, False])
async def test_prompt_token_ids_forwarded_only_when_asked(forward):
    async with cluster("relay", forward_prompt_token_ids=forward) as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 200, reply.body
        [pf] = prefill.requests_to("/chat/completions")
        [dc] = decode.requests_to("/chat/completions")
        assert pf.body.get("return_token_ids") is (True if forward else None)
        ids = dc.body["kv_transfer_params"].get("prompt_token_ids")
        assert (isinstance(ids, list) and ids) if forward else ids is None
        assert decode.tokenization_skipped == (1 if forward else 0)


async def test_messages_eos_first_token_is_recomputed_under_mooncake():
    """vLLM drops unknown fields on /v1/messages: ignore_eos cannot be sent, so an
    EOS first token on the prefill leg frees the KV (the README gives the rate). The
    prefill's answer says so (stop_reason end_turn): the decode waiting for that KV
    is closed and a new one computes the prompt, instead of waiting out Mooncake's
    abort timeout (480 s; the demo's 5 s here) to fail."""
    prefill, decode = await start_pair(eos_first=1.0, kv_wait_timeout=5.0)
    config = config_for(f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}", decode.url,
                        kv_protocol="mooncake")
    try:
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", MESSAGES_PATH, messages_body(), timeout=3)
            assert reply.status == 200, reply.body
            assert reply.json()["type"] == "message"
            legs = decode.requests_to("/messages")
            assert len(legs) == 2 and "kv_transfer_params" in legs[0].body
            assert "kv_transfer_params" not in legs[1].body  # computed by decode itself
            await proxy.request("POST", "/v1/chat/completions", chat())
            metrics = (await proxy.request("GET", "/metrics")).body.decode()
            assert 'outcome="stopped"} 1' in metrics, metrics
            await asyncio.sleep(0)
        assert len(prefill.kv_dropped) == 1  # the Messages request's; chat has ignore_eos
    finally:
        await prefill.close()
        await decode.close()


def test_route_and_surface_finds_the_surface_once_with_the_route():
    assert route_and_surface(b"POST", "/gw/v1/chat/completions") == (GENERATION, CHAT)
    assert route_and_surface(b"POST", "/v1/messages") == (GENERATION, MESSAGES)
    assert route_and_surface(b"GET", "/v1/chat/completions") == (PASSTHROUGH, None)
    assert route_and_surface(b"POST", "/v1/embeddings") == (PASSTHROUGH, None)
    for method, path in ((b"POST", "/v1/completions"), (b"GET", "/healthz"),
                         (b"PUT", "/v1/instances/add")):
        assert route_and_surface(method, path)[0] == classify(method, path)


@pytest.mark.parametrize("surface, answer, stopped", [
    (CHAT, {"choices": [{"finish_reason": "stop"}]}, True),
    (CHAT, {"choices": [{"finish_reason": "length"}]}, False),
    (COMPLETIONS, {"choices": [{"finish_reason": "stop"}]}, True),
    (CHAT, {"choices": []}, False),
    (CHAT, {"choices": "stop"}, False),
    (MESSAGES, {"stop_reason": "end_turn"}, True),
    (MESSAGES, {"stop_reason": "stop_sequence"}, True),
    (MESSAGES, {"stop_reason": "max_tokens"}, False),
    (RESPONSES, {"status": "completed"}, False),  # vLLM's catch-all: not certain
    (RESPONSES, {"status": "incomplete"}, False),
    (GENERATE, {"meta_info": {"finish_reason": {"type": "stop"}}}, False),  # not known
])
def test_a_prefill_answer_that_stopped_is_told_from_a_length_capped_one(surface, answer,
                                                                        stopped):
    from lowproxy.proxy.failures import finished_stopped, prefill_outcome
    assert finished_stopped(surface, answer) is stopped
    raw = json.dumps(answer).encode()
    assert prefill_outcome(200, raw, False, None, surface).outcome == \
        ("stopped" if stopped else "ok")
    assert prefill_outcome(200, raw, False, None, None).outcome == "ok"  # not Mooncake
