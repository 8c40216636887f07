"""Every request naming a new unknown model started a refresh of every decode's model
list, so a client drove GET /v1/models at its own request rate (session 36 audit):
refreshes for models not found now begin at most once a spacing."""

from __future__ import annotations

import time

from test_routing import known, proxy_for

from helpers import CHAT, chat, pd_backends
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
