"""What lowproxy answers 400 before either leg, and what it must let through.

Over real sockets to the demo backends, which answer as vLLM's request models
do: a request decode would reject after prefill computed its KV (which vLLM
then never frees) reaches neither backend; a request vLLM serves is served.
The rules themselves are unit-tested in test_vllm_rules.py and
test_request_model.py.
"""

from __future__ import annotations

import pytest

from helpers import CHAT, chat, legs, pd_setup

COMPLETIONS = "/v1/completions"


def _completion(**extra):
    return {"model": "demo-model", "prompt": "hello", "max_tokens": 3, **extra}


async def _refused_before_legs(proxy, prefill, decode, path, body, param):
    reply = await proxy.request("POST", path, body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert prefill.received == [] and decode.received == []
    assert prefill.bootstrap_queries == 0


# -- vLLM's before-validators, followed exactly (truthiness, prompt_logprobs > 0 or -1)


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_empty_stream_options_without_stream_is_served(kv_protocol):
    async with pd_setup(kv_protocol) as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(stream_options={}))
        assert reply.status == 200, reply.body
        [pf], [dc] = legs(prefill, decode)
        assert "stream_options" not in pf.body and dc.body["stream_options"] == {}


async def test_prompt_logprobs_zero_streams_and_one_is_refused():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request("POST", COMPLETIONS,
                                    _completion(stream=True, prompt_logprobs=0))
        assert reply.status == 200, reply.body
        assert reply.body.endswith(b"data: [DONE]\n\n")
        assert len(decode.requests_to(COMPLETIONS)) == 1  # decode alone: prompt_logprobs set
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        await _refused_before_legs(proxy, prefill, decode, COMPLETIONS,
                                   _completion(stream=True, prompt_logprobs=1),
                                   "prompt_logprobs")


# -- values vLLM's request models refuse in a field the prefill leg cleans off
# (the audit's examples: prefill accepted them and computed a KV that stayed pinned)

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"top_logprobs": "3x", "logprobs": True}, "top_logprobs"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"min_tokens": "abc"}, "min_tokens"),
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"n": "abc"}, "n"),
    ({"stream": "maybe"}, "stream"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options"),
])
async def test_chat_values_decode_refuses_reach_no_backend(kv_protocol, extra, param):
    async with pd_setup(kv_protocol) as (proxy, prefill, decode):
        await _refused_before_legs(proxy, prefill, decode, CHAT, chat(**extra), param)


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, _completion(n=None), "n"),
    (COMPLETIONS, _completion(logprobs="2"), "logprobs"),
    (RESPONSES, {"model": "demo-model", "input": "hi", "max_output_tokens": "abc"},
     "max_output_tokens"),
    (RESPONSES, {"model": "demo-model", "input": "hi", "store": "maybe"}, "store"),
])
async def test_other_surfaces_values_decode_refuses_reach_no_backend(path, body, param):
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        await _refused_before_legs(proxy, prefill, decode, path, body, param)


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 0}, {"max_tokens": "abc"}])
async def test_messages_cap_decode_refuses_reaches_no_backend_in_anthropic_shape(extra):
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request("POST", MESSAGES, body)
        assert reply.status == 400, reply.body
        assert reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in reply.json()["error"]["message"]
        assert prefill.received == [] and decode.received == []


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_lax_values_vllm_accepts_are_served(kv_protocol):
    # pydantic's lax mode takes these; the prefill leg gets its own, decode the client's.
    client = chat(ignore_eos="yes", logprobs="true", top_logprobs=2, stop_token_ids=[5],
                  min_tokens=0, stop="\n\n", n=2)
    async with pd_setup(kv_protocol) as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, client)
        assert reply.status == 200, reply.body
        [pf], [dc] = legs(prefill, decode)
        assert pf.body["ignore_eos"] is True and pf.body["n"] == 1
        assert {k: dc.body[k] for k in ("ignore_eos", "logprobs", "top_logprobs")} == {
            "ignore_eos": "yes", "logprobs": "true", "top_logprobs": 2}


# -- logprob_token_ids needs logprobs, which the prefill leg drops: it goes too


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
@pytest.mark.parametrize("path, client", [
    (CHAT, chat(logprobs=True, logprob_token_ids=[1, 2])),
    (COMPLETIONS, _completion(logprobs=0, logprob_token_ids=[3])),
])
async def test_logprob_token_ids_with_logprobs_is_served(kv_protocol, path, client):
    async with pd_setup(kv_protocol) as (proxy, prefill, decode):
        reply = await proxy.request("POST", path, client)
        assert reply.status == 200, reply.body
        [pf], [dc] = legs(prefill, decode, path.removeprefix("/v1"))
        assert "logprob_token_ids" not in pf.body and "logprobs" not in pf.body
        assert dc.body["logprob_token_ids"] == client["logprob_token_ids"]


@pytest.mark.parametrize("path, client", [
    (CHAT, chat(logprob_token_ids=[1])),  # without logprobs: true
    (CHAT, chat(logprobs=True, logprob_token_ids=[])),
    (CHAT, chat(logprobs=True, logprob_token_ids=["a"])),
    (COMPLETIONS, _completion(logprob_token_ids=[1])),  # without logprobs set
])
async def test_logprob_token_ids_decode_refuses_reach_no_backend(path, client):
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        await _refused_before_legs(proxy, prefill, decode, path, client, "logprob_token_ids")


async def test_generate_stream_decode_refuses_reaches_no_backend():
    body = {"model": "demo-model", "token_ids": [1, 2, 3], "stream": "maybe",
            "sampling_params": {"max_tokens": 3}}
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        await _refused_before_legs(proxy, prefill, decode, "/inference/v1/generate", body,
                                   "stream")


# -- session 38's PROTOCOL.md audit

GENERATE = "/inference/v1/generate"


def _generate(**sampling):
    return {"model": "demo-model", "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 3, **sampling}}


@pytest.mark.parametrize("sampling, param", [
    ({"max_tokens": 3, "min_tokens": 5}, "min_tokens"),  # the prefill leg drops min_tokens
    ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": 0}, "max_tokens"),  # the prefill leg sets 1
    ({"n": 0}, "n"),
    ({"logprobs": -2}, "logprobs"),
    ({"stop": ["\n", ""]}, "stop"),
])
async def test_generate_sampling_values_decode_refuses_reach_no_backend(sampling, param):
    """SamplingParams._verify_args refuses these on decode; the prefill leg sets or
    drops each field, so prefill accepted them and computed a KV nobody read."""
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        prefill.scale_out = decode.scale_out = True  # --enable-scale-out
        await _refused_before_legs(proxy, prefill, decode, GENERATE, _generate(**sampling),
                                   param)


async def test_generate_with_prompt_logprobs_goes_to_decode_alone():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        prefill.scale_out = decode.scale_out = True
        reply = await proxy.request("POST", GENERATE, _generate(prompt_logprobs=1))
        assert reply.status == 200, reply.body
        assert prefill.requests_to(GENERATE) == [] and len(decode.requests_to(GENERATE)) == 1
        assert "kv_transfer_params" not in decode.requests_to(GENERATE)[0].body


@pytest.mark.parametrize("field", ["echo", "use_beam_search"])
@pytest.mark.parametrize("value", ["true", 1, "yes", "on"])
async def test_echo_and_beam_search_true_as_pydantic_reads_go_to_decode_alone(field, value):
    """vLLM reads "true", 1, "yes" as true: decode recomputes (echo) or drops the params
    (beam search), so a prefill leg's KV would go unread."""
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        await proxy.request("POST", COMPLETIONS, _completion(**{field: value}))
        assert prefill.requests_to(COMPLETIONS) == []
        assert "kv_transfer_params" not in decode.requests_to(COMPLETIONS)[0].body


@pytest.mark.parametrize("value", ["false", "no", 0, "off"])
async def test_stream_false_as_pydantic_reads_is_answered_as_json(value):
    """vLLM answers "stream": "false" with JSON; the GCO proxy's truthiness labelled
    it text/event-stream, which a client then cannot read."""
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(stream=value))
        assert reply.status == 200, reply.body
        assert reply.header("content-type").startswith(b"application/json")
        reply.json()


@pytest.mark.parametrize("top", [3, "3"])  # int | None in ResponsesRequest: lax, "3" is 3
async def test_responses_prefill_leg_drops_top_logprobs(top):
    body = {"model": "demo-model", "input": "hi", "max_output_tokens": 4, "top_logprobs": top}
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request("POST", RESPONSES, body)
        assert reply.status == 200, reply.body
        [pf] = prefill.requests_to(RESPONSES)
        assert "top_logprobs" not in pf.body
        assert decode.requests_to(RESPONSES)[0].body["top_logprobs"] == top
