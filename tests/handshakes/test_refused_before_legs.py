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
