"""Every request naming a new unknown model started a refresh of every decode's model
list, so a client drove GET /v1/models at its own request rate (session 36 audit):
refreshes for models not found now begin at most once a spacing."""

from __future__ import annotations

import asyncio
import time

from test_routing import known, proxy_for

from helpers import CHAT, chat, config_for, pd_backends, running_proxy, wait_until
from lowproxy.demo import start_pair
from lowproxy.routing.health import REFRESH_SPACING_SECONDS


async def test_new_unknown_models_refresh_the_lists_at_most_once_a_second():
    assert REFRESH_SPACING_SECONDS == 1.0
    async with pd_backends(served_model_names=["alpha"]) as (pre, dec):
        async with proxy_for(pre, dec, health_interval=60) as running:
            await known(running)
            before = len(dec[0].requests_to("/v1/models"))
            started, replies = time.monotonic(), []
            while time.monotonic() - started < 1.5:  # a new unknown name each request
                replies.append(await running.request("POST", CHAT,
                                                     chat(model=f"nope-{len(replies)}")))
            assert {reply.status for reply in replies} == {404}
            # Each name still waits for a refresh begun after it was asked for
            # (an adapter may have just been loaded), but in 1.5 s at most three
            # begin, where each request began its own before.
            assert len(dec[0].requests_to("/v1/models")) - before <= 3


async def test_a_model_found_missing_is_found_once_loaded_without_a_health_round():
    """A name answered 404 is answered 404 at once the next time, but that request also
    begins a refresh (one a spacing at most, not waited for): an adapter loaded since is
    served within about a second, not at the next health round (60 s here)."""
    async with pd_backends(served_model_names=["alpha"]) as (pre, dec):
        async with proxy_for(pre, dec, health_interval=60) as running:
            await known(running)
            assert (await running.request("POST", CHAT, chat(model="late"))).status == 404
            for backend in pre + dec:
                backend.served_model_names.append("late")
            await asyncio.sleep(REFRESH_SPACING_SECONDS + 0.1)
            lists = len(dec[0].requests_to("/v1/models"))
            started = time.monotonic()
            # Answered at once from what is known (404), with a refresh begun behind it.
            assert (await running.request("POST", CHAT, chat(model="late"))).status == 404
            assert time.monotonic() - started < 0.5
            await wait_until(lambda: len(dec[0].requests_to("/v1/models")) > lists, 3,
                             "a refresh begun by the request")
            await wait_until(lambda: running.proxy.decode.serves("late"), 3, "late learned")
            assert (await running.request("POST", CHAT, chat(model="late"))).status == 200


async def test_under_sglang_no_model_name_is_refused_before_the_legs():
    """SGLang checks no model name ("default", its LoRA "base:adapter" names, aliases):
    the name goes to both legs, as through SGLang's own routers."""
    prefill, decode = await start_pair(served_model_names=["m"], sglang_pd=True)
    try:
        config = config_for(prefill.url, decode.url, kv_protocol="sglang",
                            health_interval=60)
        async with running_proxy(config) as running:
            await wait_until(lambda: running.proxy.decode.lists_known(), 10, "lists known")
            for name in ("default", "m:my-lora", "gpt-4o"):
                reply = await running.request("POST", CHAT, chat(model=name))
                assert reply.status == 200, (name, reply.body)
                assert [leg.body["model"] for leg in prefill.requests_to("/chat/completions")
                        ][-1:] == [name], name
                assert [leg.body["model"] for leg in decode.requests_to("/chat/completions")
                        ][-1:] == [name], name
    finally:
        await prefill.close()
        await decode.close()
