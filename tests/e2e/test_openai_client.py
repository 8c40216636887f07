"""The official openai SDK against the proxy: what users of the GCO endpoint run."""

from __future__ import annotations

import openai
import pytest

from helpers import client_for, config_for, free_port, pd_setup, running_proxy


async def test_chat_streaming():
    async with pd_setup() as (proxy, prefill, decode):
        async with client_for(proxy.port) as client:
            stream = await client.chat.completions.create(
                model="demo-model", messages=[{"role": "user", "content": "hi"}],
                max_tokens=5, stream=True, stream_options={"include_usage": True})
            text, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    usage = chunk.usage
        assert "".join(text) == "tok0 tok1 tok2 tok3 tok4 "
        assert usage is not None and usage.completion_tokens == 5
        [pf], [dc] = prefill.received, decode.received
        assert pf.body["stream"] is False and "stream_options" not in pf.body
        assert dc.body["stream"] is True and dc.body["stream_options"] == {"include_usage": True}
        assert dc.body["kv_transfer_params"]["do_remote_prefill"] is True
        # The SDK's own headers that are end-to-end reach decode; its auth does not.
        assert dc.header("authorization") is None and dc.header("x-stainless-lang") is None
        assert dc.header("user-agent") is not None


async def test_chat_non_streaming():
    async with pd_setup() as (proxy, prefill, decode):
        async with client_for(proxy.port) as client:
            answer = await client.chat.completions.create(
                model="demo-model", messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=3)
        assert answer.choices[0].message.content == "tok0 tok1 tok2 "
        assert prefill.received[0].body["max_completion_tokens"] == 1


async def test_completions():
    async with pd_setup() as (proxy, prefill, decode):
        async with client_for(proxy.port) as client:
            answer = await client.completions.create(model="demo-model", prompt="say",
                                                     max_tokens=2)
            stream = await client.completions.create(model="demo-model", prompt="say",
                                                     max_tokens=3, stream=True)
            streamed = [chunk.choices[0].text async for chunk in stream]
        assert answer.choices[0].text == "tok0 tok1 "
        assert answer.usage.completion_tokens == 2
        assert "".join(streamed) == "tok0 tok1 tok2 "
        assert [r.path for r in prefill.received] == ["/v1/completions"] * 2


async def test_models_list():
    async with pd_setup() as (proxy, prefill, decode):
        async with client_for(proxy.port) as client:
            models = [model.id async for model in client.models.list()]
        assert models == ["demo-model"]
        assert decode.received[0].target == "/v1/models" and prefill.received == []


async def test_embeddings():
    async with pd_setup() as (proxy, prefill, decode):
        async with client_for(proxy.port) as client:
            answer = await client.embeddings.create(model="demo-model", input="x",
                                                    encoding_format="float")
        assert answer.data[0].embedding == [0.1, 0.2, 0.3]
        assert prefill.received == []


@pytest.mark.parametrize("stream", [False, True])
async def test_no_decode_surfaces_as_api_status_error(stream):
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_proxy(config_for((), dead)) as proxy:
        async with client_for(proxy.port) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(
                    model="demo-model", messages=[{"role": "user", "content": "hi"}],
                    stream=stream)
    assert caught.value.status_code == 503
    assert caught.value.body == {"message": "no available decode backend",
                                 "type": "no_decode_backend"}


async def test_decode_error_surfaces_with_its_status():
    async with pd_setup() as (proxy, prefill, decode):
        decode.faults.status = 429
        async with client_for(proxy.port) as client:
            with pytest.raises(openai.RateLimitError) as caught:
                await client.completions.create(model="demo-model", prompt="x", max_tokens=2)
    assert caught.value.status_code == 429
