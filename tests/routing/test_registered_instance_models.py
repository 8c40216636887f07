"""Issue 19, defect 5: a decode registered for another model gets none of this model's
requests, from the moment /instances/add answers (the model list its registration
read routes at once), whether or not health checks run. Over real sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from helpers import CHAT, ScriptedBackend, chat, config_for, running_proxy, wait_until
from lowproxy.demo import DemoBackend

ADMIN = [("x-admin-api-key", "adm")]
OTHER_MODELS = {"object": "list", "data": [{"id": "other-model", "max_model_len": 4096}]}


async def other_model_decode(request: Any, responder: Any) -> None:
    """Lists another model; its health check never ends (its first check stays pending)."""
    if request.path == "/health":
        await asyncio.Event().wait()
    if request.path == "/v1/models":
        await responder.send_json(200, OTHER_MODELS)
        return
    await responder.send_json(200, {"id": "cmpl-other", "object": "chat.completion",
                                    "choices": [], "usage": None})


def generations(backend: Any) -> int:
    return sum(1 for r in backend.received if r.path == CHAT)


@pytest.mark.parametrize("interval", [0.0, 30.0], ids=["checks-off", "checks-on"])
async def test_a_decode_registered_for_another_model_gets_none_of_this_model_s_requests(
        interval):
    ours = await DemoBackend("decode").start(bootstrap_port=None)
    other = await ScriptedBackend(other_model_decode).start()
    try:
        config = config_for((), ours.url, admin_api_key="adm", health_interval=interval,
                            health_timeout=20.0)
        async with running_proxy(config) as proxy:
            group = proxy.proxy.decode
            if interval:
                await wait_until(lambda: group.endpoints[0] in group.models, 10, "checked")
            reply = await proxy.request("POST", "/instances/add",
                                        {"type": "decode", "instance": other.url()},
                                        headers=ADMIN)
            assert reply.status == 200, reply.body
            # Many at once, while the new decode's first health check is still pending.
            replies = await asyncio.gather(*(proxy.request("POST", CHAT, chat())
                                             for _ in range(20)))
            assert [r.status for r in replies] == [200] * 20
            assert generations(other) == 0 and generations(ours) == 20
            assert group.models[group.endpoints[1]] == {"other-model": 4096}
            if interval:  # every list known: its own model goes to it alone
                mine = await proxy.request("POST", CHAT, chat(model="other-model"))
                assert mine.status == 200 and generations(other) == 1
    finally:
        await ours.close()
        await other.close()
