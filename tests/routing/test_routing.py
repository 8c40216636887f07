"""Routing like a scheduler (issue 15), over real sockets: active health, model knowledge,
prefill affinity with bounded loads, the short-prompt skip, the policy setting."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from helpers import (
    Client,
    Daemon,
    ScriptedBackend,
    config_for,
    eventually,
    free_port,
    pd_backends,
    request,
    running_proxy,
    wait_until,
)
from lowproxy.config import load_config
from lowproxy.demo import DemoBackend, KvRegistry

CHAT = "/v1/chat/completions"
FAST = {"health_interval": 0.2, "health_timeout": 0.5, "health_failures": 2}
# Scheduling slack on a loaded 2-core machine, on top of interval x failures + timeout.
MARGIN = 2.0


def posts(backend: Any) -> list[Any]:
    return [r for r in backend.received if r.method == "POST"]


def conversation(n: int, *turns: str, model: str = "demo-model") -> dict[str, Any]:
    messages = [{"role": "system", "content": f"system prompt of conversation {n} " * 20}]
    for index, turn in enumerate(turns or ("hello",)):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": turn})
    return {"model": model, "messages": messages, "max_tokens": 4}


def conversation_of(received: Any) -> str:
    return received.body["messages"][0]["content"]


def proxy_for(pre: list[DemoBackend], dec: list[DemoBackend], **overrides: Any) -> Any:
    return running_proxy(config_for([b.url for b in pre], [b.url for b in dec], **overrides))


async def known(running: Any) -> None:
    """Every endpoint checked and its models learned."""
    proxy = running.proxy
    await wait_until(lambda: all(
        group.health_state(e) == "healthy" and e in group.models
        for group in (proxy.prefill, proxy.decode) for e in group.endpoints), 10, "first checks")


# -- active health


async def test_a_closed_decode_turns_readyz_503_without_traffic_and_back():
    async with pd_backends(prefills=0) as (_, (decode,)):
        port = decode.port
        async with proxy_for([], [decode], **FAST) as running:
            await known(running)
            assert (await running.request("GET", "/readyz")).status == 200
            await decode.close()  # killed: its port refuses connections
            closed = time.monotonic()
            bound = 0.2 * 2 + 0.5 + MARGIN
            while (ready := await running.request("GET", "/readyz")).status != 503:
                assert time.monotonic() - closed < bound, "readyz still 200"
                await asyncio.sleep(0.02)
            assert ready.json()["reason"] == "no healthy decode endpoint"
            assert posts(decode) == []  # no client request taught it
            metrics = (await running.request("GET", "/metrics")).body.decode()
            label = f'role="decode",endpoint="{decode.url}"'
            assert f'lowproxy_endpoint_health{{{label},state="unhealthy"}} 1' in metrics
            assert f'lowproxy_endpoint_failures_total{{{label},kind="health"}}' in metrics
            back = await DemoBackend("decode").start(port=port, bootstrap_port=None)
            try:
                returned = time.monotonic()
                while (await running.request("GET", "/readyz")).status != 200:
                    assert time.monotonic() - returned < 0.2 + 0.5 + MARGIN, "not back"
                    await asyncio.sleep(0.02)
                reply = await running.request("POST", CHAT, conversation(1))
                assert reply.status == 200 and len(posts(back)) == 1
            finally:
                await back.close()


async def hanging_health(request: Any, responder: Any) -> None:
    if request.path == "/health":
        await asyncio.Event().wait()  # never answers; the proxy's bound closes it
    await responder.send_json(200, {"object": "list", "data": []})


async def test_a_hanging_endpoint_delays_no_other_check_and_is_never_picked():
    hung = await ScriptedBackend(hanging_health).start()
    async with pd_backends(prefills=0) as (_, (decode,)):
        try:
            async with running_proxy(config_for([], [hung.url(), decode.url], **FAST)) as running:
                group = running.proxy.decode
                hung_endpoint = group.endpoints[0]
                # The live decode is checked every interval while the hung check waits.
                await wait_until(lambda: len(decode.requests_to("/health")) >= 4, 10,
                                 "checks of the live decode")
                await wait_until(lambda: hung_endpoint in group.unhealthy, 10, "hung out")
                # One check at a time per endpoint: checks of a hung one do not pile up
                # (each one the proxy gave up on was hung up on, as its bound says).
                for _ in range(5):
                    waiting = len([r for r in hung.received if r.path == "/health"])
                    assert waiting - hung.hung_up <= 1
                    await asyncio.sleep(0.1)
                for n in range(4):
                    assert (await running.request("POST", CHAT, conversation(n))).status == 200
                assert len(posts(decode)) == 4 and posts(hung) == []
            assert running.proxy.health.checking == {}  # closed: no check left running
        finally:
            await hung.close()


# -- model knowledge


async def test_an_unknown_model_is_404_after_one_refresh_and_no_leg_is_sent():
    async with pd_backends(served_model_names=["alpha"], max_model_len=1000) as (pre, dec):
        async with proxy_for(pre, dec, health_interval=60) as running:
            await known(running)
            lists_before = len(dec[0].requests_to("/v1/models"))
            reply = await running.request("POST", CHAT, conversation(1, model="nope"))
            assert reply.status == 404
            assert reply.json() == {"error": {
                "message": "The model `nope` does not exist.", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}}
            assert len(dec[0].requests_to("/v1/models")) == lists_before + 1  # one refresh
            again = await running.request("POST", CHAT, conversation(2, model="nope"))
            assert again.status == 404
            assert len(dec[0].requests_to("/v1/models")) == lists_before + 1  # not again
            # An adapter loaded meanwhile is found by the refresh its first request asks.
            for backend in pre + dec:
                backend.served_model_names.append("late-lora")
            assert (await running.request("POST", CHAT, conversation(3, model="late-lora"))
                    ).status == 200
            too_long = conversation(4, model="alpha")
            too_long["max_tokens"] = 1001
            refused = await running.request("POST", CHAT, too_long)
            assert refused.status == 400 and refused.json()["error"]["param"] == "max_tokens"
            capped = {"model": "alpha", "prompt": "hi", "max_tokens": 5000}
            assert (await running.request("POST", "/v1/completions", capped)).status == 400
            assert [conversation_of(r) for r in posts(pre[0]) + posts(pre[1])] == [
                conversation(3)["messages"][0]["content"]]
            assert len(posts(dec[0])) == 1


async def models_unknown(request: Any, responder: Any) -> None:
    if request.path == "/v1/models":
        await responder.send_json(404, {"detail": "Not Found"})
        return
    await responder.send_json(200, {"choices": [], "path": request.path})


async def test_without_model_lists_requests_go_as_before():
    decode = await ScriptedBackend(models_unknown).start()
    try:
        async with running_proxy(config_for([], [decode.url()], **FAST)) as running:
            group = running.proxy.decode
            await wait_until(lambda: group.health_state(group.endpoints[0]) == "healthy", 10)
            await wait_until(lambda: len([r for r in decode.received
                                          if r.path == "/v1/models"]) >= 1, 10)
            body = conversation(1, model="anything")
            body["max_tokens"] = 10**6
            assert (await running.request("POST", CHAT, body)).status == 200
    finally:
        await decode.close()


async def test_each_model_goes_only_to_endpoints_serving_it_in_both_roles():
    registry = KvRegistry()
    alpha_pre = await DemoBackend("prefill", registry=registry,
                                  served_model_names=["alpha"]).start()
    beta_pre = await DemoBackend("prefill", registry=registry,
                                 served_model_names=["beta"]).start()
    alpha_dec = await DemoBackend("decode", registry=registry,
                                  served_model_names=["alpha"]).start(bootstrap_port=None)
    beta_dec = await DemoBackend("decode", registry=registry,
                                 served_model_names=["beta"]).start(bootstrap_port=None)
    try:
        async with proxy_for([alpha_pre, beta_pre], [alpha_dec, beta_dec],
                             health_interval=60, prefill_policy="round-robin") as running:
            await known(running)
            for n in range(3):
                for model in ("alpha", "beta"):
                    reply = await running.request("POST", CHAT, conversation(n, model=model))
                    assert reply.status == 200, reply.body
            for backend, model in ((alpha_pre, "alpha"), (beta_pre, "beta"),
                                   (alpha_dec, "alpha"), (beta_dec, "beta")):
                assert [r.body["model"] for r in posts(backend)] == [model] * 3
    finally:
        for backend in (alpha_pre, beta_pre, alpha_dec, beta_dec):
            await backend.close()


# -- prefill choice


async def test_affinity_keeps_each_conversation_on_one_prefill_and_replicas_agree():
    async with pd_backends() as (pre, dec):
        async with proxy_for(pre, dec, prefill_policy="affinity") as one, \
                proxy_for(pre, dec, prefill_policy="affinity") as two:
            for n in range(16):
                for running, turns in ((one, ("hello",)), (two, ("hello", "hi", "and?")),
                                       (one, ("hello", "hi", "more"))):
                    reply = await running.request("POST", CHAT, conversation(n, *turns))
                    assert reply.status == 200, reply.body
            homes: dict[str, set[int]] = {}
            for index, backend in enumerate(pre):
                for received in posts(backend):
                    homes.setdefault(conversation_of(received), set()).add(index)
            assert len(homes) == 16 and all(len(where) == 1 for where in homes.values())
            assert {next(iter(where)) for where in homes.values()} == {0, 1}  # both used
            for running in (one, two):
                choices = running.proxy.metrics.prefill_choice
                assert choices.get("affinity") == 16 * (2 if running is one else 1)
                assert running.proxy.prefill_choice.outstanding == {}  # released


async def test_round_robin_and_least_loaded_spread_one_prefix_over_both():
    for policy, reason in (("round-robin", "round-robin"), ("least-loaded", "load")):
        async with pd_backends() as (pre, dec):
            async with proxy_for(pre, dec, prefill_policy=policy) as running:
                for _ in range(4):
                    assert (await running.request("POST", CHAT, conversation(1))).status == 200
                assert [len(posts(b)) for b in pre] == [2, 2], policy
                assert running.proxy.metrics.prefill_choice.get(reason) == 4
    config, _ = load_config([], {"PD_PROXY_PREFILL_POLICY": "least-loaded"})
    assert config.prefill_policy == "least-loaded"
    assert load_config([], {})[0].prefill_policy == "cache-aware"


async def test_the_scheduler_header_still_wins_over_affinity():
    async with pd_backends() as (pre, dec):
        async with proxy_for(pre, dec, prefill_policy="affinity",
                             prefill_header_allow=("127.0.0.1",)) as running:
            assert (await running.request("POST", CHAT, conversation(5))).status == 200
            home = 0 if posts(pre[0]) else 1
            other = pre[1 - home]
            target = f"127.0.0.1:{other.port}".encode()
            for _ in range(3):
                reply = await running.request("POST", CHAT, conversation(5),
                                              headers=[(b"x-prefiller-host-port", target)])
                assert reply.status == 200
            assert len(posts(other)) == 3 and len(posts(pre[home])) == 1
            assert running.proxy.metrics.prefill_choice.get("header") == 3


async def test_short_prompts_skip_prefill_and_are_counted():
    async with pd_backends(prefills=1) as (pre, dec):
        async with proxy_for(pre, dec, min_prefill_prompt_bytes=200) as running:
            short = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}
            assert (await running.request("POST", CHAT, short)).status == 200
            assert posts(pre[0]) == [] and len(posts(dec[0])) == 1
            assert "kv_transfer_params" not in posts(dec[0])[0].body
            assert running.proxy.metrics.prefill_legs.get("relay", "skipped", "short") == 1
            assert (await running.request("POST", CHAT, conversation(1))).status == 200
            assert len(posts(pre[0])) == 1  # a long prompt is disaggregated
            metrics = (await request(running.port, "GET", "/metrics")).body.decode()
            assert 'reason="short"' in metrics
            assert f'lowproxy_endpoint_in_flight{{role="decode",endpoint="{dec[0].url}"}} 0' \
                in metrics
            assert f'lowproxy_endpoint_requests_total{{role="prefill",endpoint="{pre[0].url}"}} 1' \
                in metrics




@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_concurrent_unknown_models_never_wedge_the_daemon(loop):
    """Issue 19.1: twenty requests at once for models no decode serves, round after
    round, against the daemon and demo backends as processes of their own (the timing
    that found it). Every one is 404, /healthz answers between the rounds and SIGTERM
    ends the daemon; the old wait spun on a finished refresh for ever."""
    decode_port, prefill_port = free_port(), free_port()
    demos = [subprocess.Popen([sys.executable, "-m", "lowproxy.demo", "--role", role,
                               "--port", str(port), "--bootstrap-port", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for role, port in (("prefill", prefill_port), ("decode", decode_port))]
    daemon = Daemon(["--port", "0", "--loop", loop], {
        "PD_PROXY_PREFILL_URL": f"http://127.0.0.1:{prefill_port}",
        "PD_PROXY_DECODE_URL": f"http://127.0.0.1:{decode_port}",
        "PD_PROXY_HEALTH_INTERVAL_SECONDS": "60"})
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        await eventually(lambda: _knows_models(port), 15, "decode's models learned")
        for round_ in range(3):  # each round waits out the refresh spacing (1 s)
            replies = await asyncio.wait_for(asyncio.gather(*(
                request(port, "POST", CHAT, conversation(n, model=f"nope-{round_}-{n}"))
                for n in range(20))), 10.0)
            assert [r.status for r in replies] == [404] * 20
            health = await asyncio.wait_for(request(port, "GET", "/healthz"), 3.0)
            assert health.status == 200
        assert await asyncio.to_thread(daemon.stop) == 0  # SIGTERM still heard
    finally:
        daemon.stop(signal.SIGKILL)
        for demo in demos:
            demo.kill()
            demo.wait()


async def _knows_models(port: int) -> bool:
    """One unknown model at a time is answered 404 once decode's list is known."""
    reply = await request(port, "POST", CHAT, conversation(0, model="nope-alone"))
    return reply.status == 404


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_the_prefill_load_is_released_once_when_the_prefill_leg_ends_mid_stream(
        monkeypatch: pytest.MonkeyPatch, kv_protocol: str) -> None:
    """Dispatch reports the leg's end once: the load goes while decode still streams."""
    from lowproxy.routing.prefill import PrefillLease

    releases: list[int] = []
    release = PrefillLease.release

    def counted(lease: PrefillLease) -> None:
        releases.append(lease.cost)
        release(lease)

    monkeypatch.setattr(PrefillLease, "release", counted)
    more = asyncio.Event()

    async def stream(request: Any, responder: Any) -> None:
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        await responder.write(b'data: {"choices": []}\n\n')
        await more.wait()
        await responder.write(b"data: [DONE]\n\n")
        await responder.end()

    prefill = await DemoBackend("prefill", registry=KvRegistry()).start()
    decode = await ScriptedBackend(stream).start()
    url = f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}"
    try:
        async with running_proxy(config_for(url, decode.url(), kv_protocol=kv_protocol,
                                            prefill_policy="least-loaded")) as running:
            client = await Client.open(running.port)
            client.send("POST", CHAT, conversation(1) | {"stream": True})
            so_far = await client.read_until(b"data: {")
            assert not so_far.complete  # decode is still streaming
            assert running.proxy.prefill_choice.outstanding == {}
            assert len(releases) == 1 and releases[0] > 1  # the prompt's bytes, once
            more.set()
            assert (await client.reply()).body.endswith(b"data: [DONE]\n\n")
            client.close()
            requests = running.proxy.metrics.requests
            await wait_until(lambda: requests.get("generation", "200") == 1, 5, "request end")
            assert len(releases) == 1  # not again when the request ended
    finally:
        more.set()
        await decode.close()
        await prefill.close()



@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_no_prefill_leg_while_every_decode_fails_its_checks(kv_protocol):
    """A KV computed while no decode is healthy would be read by nobody (pinned for
    minutes under Mooncake): the prefill leg is skipped and decode is still tried with
    the whole prompt, so the client gets the no-decode answer and prefill did nothing;
    once decode is back, requests have both legs again."""
    async with pd_backends(prefills=1) as ((prefill,), (decode,)):
        port = decode.port
        prefill_url = f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}"
        config = config_for(prefill_url, decode.url, kv_protocol=kv_protocol, **FAST)
        async with running_proxy(config) as running:
            await known(running)
            await decode.close()
            await wait_until(lambda: not running.proxy.decode.candidates(None), 5,
                             "decode unhealthy")
            for _ in range(3):
                reply = await running.request("POST", CHAT, conversation(1))
                assert reply.status == 503, reply.body
            assert posts(prefill) == []
            metrics = (await running.request("GET", "/metrics")).body.decode()
            assert f'handshake="{kv_protocol}",outcome="skipped",reason="no-healthy-decode"' \
                in metrics
            back = await DemoBackend("decode", registry=prefill.registry).start(
                port=port, bootstrap_port=None)
            try:
                await wait_until(lambda: bool(running.proxy.decode.candidates(None)), 5,
                                 "decode healthy again")
                reply = await running.request("POST", CHAT, conversation(2))
                assert reply.status == 200 and len(posts(prefill)) == 1
            finally:
                await back.close()


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_no_prefill_leg_while_every_decode_cools_down(kv_protocol):
    """A decode that refused a connection moments ago is cooling down before any
    health check has seen it fail: while every decode is, a KV computed now would be
    read by nobody, so the prefill leg is skipped (decode is still tried)."""
    async with pd_backends(prefills=1) as ((prefill,), (decode,)):
        prefill_url = f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}"
        # Checks far apart: only the refused connection tells decode is gone.
        config = config_for(prefill_url, decode.url, kv_protocol=kv_protocol,
                            health_interval=60.0)
        async with running_proxy(config) as running:
            await known(running)
            await decode.close()
            first = await running.request("POST", CHAT, conversation(1))
            assert first.status in (502, 503), first.body
            sent = len(posts(prefill))
            assert running.proxy.decode.candidates(None)  # still healthy by its checks
            assert running.proxy.decode.none_ready(None)  # but cooling down
            for _ in range(3):
                reply = await running.request("POST", CHAT, conversation(2))
                assert reply.status in (502, 503), reply.body
            assert len(posts(prefill)) == sent  # no prefill leg while it cools down
            metrics = (await running.request("GET", "/metrics")).body.decode()
            assert f'handshake="{kv_protocol}",outcome="skipped",reason="no-healthy-decode"' \
                in metrics


class SlowHealthDecode(DemoBackend):
    """A decode whose /health stalls (a busy engine's API loop) while it serves."""

    slow = False

    async def handle(self, request: Any, responder: Any) -> None:
        if self.slow and request.path == "/health":
            await asyncio.sleep(3)
        await super().handle(request, responder)


async def test_a_decode_out_by_slow_checks_but_serving_keeps_its_prefill_legs():
    """The no-healthy-decode skip is for a decode nobody reaches. One whose checks time
    out under load while it answers requests is serving: skipping the prefill legs
    then would put every prompt on it just when it is busiest (llm-d audit)."""
    registry = KvRegistry()
    prefill = await DemoBackend("prefill", registry=registry).start()
    decode = await SlowHealthDecode("decode", registry=registry).start(bootstrap_port=None)
    try:
        config = config_for(prefill.url, decode.url, health_interval=0.2, health_timeout=0.3,
                            health_failures=1)
        async with running_proxy(config) as running:
            await known(running)
            assert (await running.request("POST", CHAT, conversation(1))).status == 200
            decode.slow = True
            await wait_until(lambda: not running.proxy.decode.candidates(None), 5,
                             "decode out by its checks")
            reply = await running.request("POST", CHAT, conversation(2))
            assert reply.status == 200, reply.body
            assert len(posts(prefill)) == 2  # the prefill leg was still sent
            assert "kv_transfer_params" in decode.received[-1].body
    finally:
        await decode.close()
        await prefill.close()
