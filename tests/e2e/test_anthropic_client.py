"""The official anthropic SDK against the proxy's Messages surface: its key header
(x-api-key) and its error shape, as an Anthropic SDK user meets them."""

from __future__ import annotations

import anthropic
import pytest

from helpers import config_for, pd_setup, running_proxy, wait_until
from lowproxy.demo import DemoBackend

KEY = "ck-sdk-client"


def client_for(port: int, key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key=key,
                                    max_retries=0, timeout=10)


async def test_the_sdk_key_is_accepted_streamed_and_not_forwarded():
    async with pd_setup(client_api_keys=(KEY,)) as (proxy, prefill, decode):
        async with client_for(proxy.port) as client:
            answer = await client.messages.create(
                model="demo-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            assert answer.content[0].text == "tok0 tok1 tok2 tok3 "
            async with client.messages.stream(
                    model="demo-model", max_tokens=3,
                    messages=[{"role": "user", "content": "hi"}]) as stream:
                text = "".join([chunk async for chunk in stream.text_stream])
            assert text == "tok0 tok1 tok2 "
        for leg in prefill.received + decode.received:
            assert leg.header("x-api-key") is None and leg.header("authorization") is None


async def test_a_wrong_key_is_the_sdks_authentication_error():
    async with pd_setup(client_api_keys=(KEY,)) as (proxy, prefill, decode):
        async with client_for(proxy.port, "not-the-key") as client:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                await client.messages.create(
                    model="demo-model", max_tokens=4,
                    messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 401
        assert caught.value.body["error"]["type"] == "authentication_error"
        assert decode.received == [] and prefill.received == []


async def test_an_unknown_model_is_the_sdks_not_found_error():
    decode = await DemoBackend("decode", served_model_names=["alpha"]).start(bootstrap_port=None)
    try:
        async with running_proxy(config_for((), decode.url, health_interval=60)) as running:
            await wait_until(running.proxy.decode.lists_known, 10, "model lists")
            async with client_for(running.port) as client:
                with pytest.raises(anthropic.NotFoundError) as caught:
                    await client.messages.create(
                        model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            assert caught.value.body["error"]["type"] == "not_found_error"
            assert "nope" in caught.value.message
    finally:
        await decode.close()
