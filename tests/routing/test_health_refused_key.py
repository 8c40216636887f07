"""Issue 19: a backend answering lowproxy's health check with 401/403 is misconfigured.

The endpoint is out at once (not after PD_PROXY_HEALTH_FAILURES), /readyz answers
503, and one warning names the settings that hold the backend key, never the key.
vLLM's --api-key guards /v1 only, so the demo decode refuses GET /v1/models and
answers GET /health; a backend guarding every path refuses GET /health itself.
Over real sockets, with the demo decode and a scripted one.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from helpers import ScriptedBackend, config_for, running_proxy, wait_until
from lowproxy.demo import DemoBackend, KvRegistry

RIGHT, WRONG = "right-key-4b1d", "wrong-key-9f3e"
CHECKS = {"health_interval": 0.2, "health_timeout": 2.0, "health_failures": 3}


async def refuse_everything(request: Any, responder: Any) -> None:
    await responder.send_json(403, {"error": {"message": "forbidden"}})


def key_warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "backend key" in r.getMessage()]


@pytest.mark.parametrize("kind", ["vllm-401-on-models", "403-on-health"])
async def test_a_backend_refusing_the_key_is_unhealthy_with_a_warning_naming_the_setting(
        kind, caplog, tmp_path):
    caplog.set_level(logging.INFO)
    if kind == "vllm-401-on-models":
        backend: Any = await DemoBackend("decode", api_key=RIGHT).start(bootstrap_port=None)
        url = backend.url
    else:
        backend = await ScriptedBackend(refuse_everything).start()
        url = backend.url()
    key_file = tmp_path / "backend.key"
    key_file.write_text(WRONG + "\n")
    try:
        config = config_for((), url, backend_api_key_file=str(key_file), **CHECKS)
        async with running_proxy(config) as running:
            # The first check ran before the proxy was ready: out at once.
            ready = await running.request("GET", "/readyz")
            assert ready.status == 503, ready.body
            assert ready.json()["reason"] == "no healthy decode endpoint"
            group = running.proxy.decode
            assert group.health_state(group.endpoints[0]) == "unhealthy"
            metrics = (await running.request("GET", "/metrics")).body.decode()
            assert (f'lowproxy_endpoint_health{{role="decode",endpoint="{url}",'
                    f'state="unhealthy"}} 1') in metrics
            [warning] = key_warnings(caplog)
            assert "PD_PROXY_BACKEND_API_KEY" in warning and url in warning
            assert str(403 if kind == "403-on-health" else 401) in warning
            if kind == "vllm-401-on-models":
                # The right key (the file is re-read): back in with the next check.
                key_file.write_text(RIGHT + "\n")
                await wait_until(lambda: group.health_state(group.endpoints[0]) == "healthy",
                                 10, "healthy with the right key")
                assert (await running.request("GET", "/readyz")).status == 200
            else:  # still refused on every later check: warned about once
                await wait_until(lambda: group.failed_checks[group.endpoints[0]] >= 3, 10,
                                 "more checks")
                assert len(key_warnings(caplog)) == 1
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert WRONG not in logged and RIGHT not in logged
    finally:
        await backend.close()


@pytest.mark.parametrize("kind", ["vllm-401-on-models", "403-on-health"])
async def test_with_the_clients_keys_forwarded_a_backend_wanting_a_key_is_up(kind, caplog):
    """PD_PROXY_FORWARD_AUTHORIZATION leaves lowproxy no key of its own (a backend key
    beside it is refused at start), so its checks are refused by a vLLM started with
    --api-key. That backend answered: it is up, /readyz is 200 and the prefill leg is
    sent (before, every endpoint was out for good and PD silently off)."""
    caplog.set_level(logging.INFO)
    registry = KvRegistry()
    prefill = await DemoBackend("prefill", api_key=RIGHT, registry=registry).start()
    if kind == "vllm-401-on-models":
        decode: Any = await DemoBackend("decode", api_key=RIGHT, registry=registry).start(
            bootstrap_port=None)
        url = decode.url
    else:
        decode = await ScriptedBackend(refuse_everything).start()
        url = decode.url()
    try:
        config = config_for(prefill.url, url, forward_authorization=True, **CHECKS)
        async with running_proxy(config) as running:
            assert (await running.request("GET", "/readyz")).status == 200
            assert running.proxy.decode.health_state(running.proxy.decode.endpoints[0]) \
                == "healthy"
            if kind == "vllm-401-on-models":
                reply = await running.request(
                    "POST", "/v1/chat/completions", {
                        "model": "demo-model", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hi"}]},
                    headers=[("authorization", f"Bearer {RIGHT}")])
                assert reply.status == 200, reply.body
                assert [r.path for r in prefill.received if r.method == "POST"] == [
                    "/v1/chat/completions"]
        assert not key_warnings(caplog)
        assert any("its model list is not read" in r.getMessage() for r in caplog.records)
    finally:
        await decode.close()
        await prefill.close()
