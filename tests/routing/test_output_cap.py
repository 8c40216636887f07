"""The one output cap vLLM checks against the model's context, per surface.

Chat: max_completion_tokens wins over max_tokens (vLLM's build_tok_params reads
max_completion_tokens when set, else max_tokens), so a large max_tokens beside a
small max_completion_tokens is served. Completions has no max_completion_tokens
(vLLM ignores the field), Responses caps with max_output_tokens, Messages with
max_tokens, and the generate API's cap lives in sampling_params.
"""

from __future__ import annotations

import pytest

from helpers import CHAT, config_for, pd_backends, running_proxy, wait_until
from lowproxy.routes import CHAT as CHAT_SURFACE
from lowproxy.routes import COMPLETIONS, GENERATE, MESSAGES, RESPONSES
from lowproxy.routing.health import output_cap

CONTEXT = 4096


@pytest.mark.parametrize("surface, body, capped", [
    (CHAT_SURFACE, {"max_tokens": 5000, "max_completion_tokens": 5}, ("max_completion_tokens", 5)),
    (CHAT_SURFACE, {"max_tokens": 5, "max_completion_tokens": 5000},
     ("max_completion_tokens", 5000)),
    (CHAT_SURFACE, {"max_tokens": 5000, "max_completion_tokens": None}, ("max_tokens", 5000)),
    (CHAT_SURFACE, {"max_tokens": 5000}, ("max_tokens", 5000)),
    (CHAT_SURFACE, {"max_tokens": 5000, "max_completion_tokens": "5"}, None),  # vLLM's to judge
    (CHAT_SURFACE, {"max_tokens": True}, None),
    (CHAT_SURFACE, {}, None),
    (COMPLETIONS, {"max_tokens": 5, "max_completion_tokens": 5000}, ("max_tokens", 5)),
    (COMPLETIONS, {"max_completion_tokens": 5000}, None),
    (RESPONSES, {"max_output_tokens": 5000, "max_tokens": 1}, ("max_output_tokens", 5000)),
    (RESPONSES, {"max_tokens": 5000}, None),
    (MESSAGES, {"max_tokens": 5000}, ("max_tokens", 5000)),
    (GENERATE, {"max_tokens": 5000, "sampling_params": {"max_tokens": 5}}, None),
])
def test_the_effective_cap_is_the_one_vllm_reads(surface, body, capped):
    assert output_cap(surface, body) == capped


@pytest.mark.parametrize("path, extra, refused", [
    (CHAT, {"max_tokens": 5000, "max_completion_tokens": 5}, None),
    (CHAT, {"max_tokens": 5, "max_completion_tokens": 5000}, "max_completion_tokens"),
    (CHAT, {"max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 5, "max_completion_tokens": 5000}, None),
])
async def test_only_the_effective_cap_is_held_to_the_context(path, extra, refused):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    async with pd_backends(prefills=1, max_model_len=CONTEXT) as (pre, dec), running_proxy(
            config_for([pre[0].url], [dec[0].url], health_interval=60)) as proxy:
        decode = proxy.proxy.decode
        await wait_until(lambda: all(e in decode.models for e in decode.endpoints), 10,
                         "the decode's model list")
        reply = await proxy.request("POST", path, {"model": "demo-model", **prompt, **extra})
        if refused is None:
            assert reply.status == 200, reply.body
            assert len(dec[0].requests_to(path.removeprefix("/v1"))) == 1
        else:
            assert reply.status == 400 and reply.json()["error"]["param"] == refused
            assert [r for r in pre[0].received + dec[0].received if r.method == "POST"] == []
