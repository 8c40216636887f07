"""Cache-aware routing (issue 22), over real sockets: turns stay with the prefill and the
decode holding them, shared system prompts are one placement, endpoints leaving move
only their own prefixes, replicas place cold prefixes alike, decode-first skips, and the
engines' own load reports (ORCA, /metrics) read and used."""

from __future__ import annotations

from typing import Any

from helpers import config_for, pd_backends, request, running_proxy, wait_until
from lowproxy.config import Config
from lowproxy.demo import DemoBackend
from lowproxy.handshakes.planner import Generation, plan_generation
from lowproxy.ids import Ids
from lowproxy.routing.blocks import prompt_blocks
from lowproxy.routing.cache_aware import label_salt, ranked

CHAT = "/v1/chat/completions"
ANSWER = "tok0 tok1 tok2 tok3 "  # the demo's answer to max_tokens 4


def posts(backend: DemoBackend) -> list[Any]:
    return [r for r in backend.received if r.method == "POST" and r.path == CHAT]


def system_of(received: Any) -> str:
    return received.body["messages"][0]["content"]


def turns(system: str, *users: str) -> dict[str, Any]:
    """A conversation up to its last user turn, with the demo's answers in between."""
    messages = [{"role": "system", "content": system}]
    for index, user in enumerate(users):
        if index:
            messages.append({"role": "assistant", "content": ANSWER})
        messages.append({"role": "user", "content": user})
    return {"model": "demo-model", "messages": messages, "max_tokens": 4}


def system(n: int, words: int = 200) -> str:
    return " ".join(f"s{n}w{i}" for i in range(words))


def proxy_for(pre: list[DemoBackend], dec: list[DemoBackend], **overrides: Any) -> Any:
    overrides.setdefault("prefill_policy", "cache-aware")
    return running_proxy(config_for([b.url for b in pre], [b.url for b in dec], **overrides))


def homes(group: list[DemoBackend]) -> dict[str, set[int]]:
    """System prompt -> the backends that got a leg of it."""
    where: dict[str, set[int]] = {}
    for index, backend in enumerate(group):
        for received in posts(backend):
            where.setdefault(system_of(received), set()).add(index)
    return where


async def test_a_conversations_turns_stay_with_their_prefill_and_decode():
    async with pd_backends(prefills=2, decodes=2) as (pre, dec):
        async with proxy_for(pre, dec) as running:
            for n in range(16):
                said: list[str] = []
                for turn in range(3):
                    said.append(f"question {turn} of {n} " * 8)
                    reply = await running.request("POST", CHAT, turns(system(n), *said))
                    assert reply.status == 200, reply.body
            prefills, decodes = homes(pre), homes(dec)
            assert len(prefills) == 16 and all(len(where) == 1 for where in prefills.values())
            assert len(decodes) == 16 and all(len(where) == 1 for where in decodes.values())
            assert {next(iter(w)) for w in prefills.values()} == {0, 1}  # both prefills used
            assert {next(iter(w)) for w in decodes.values()} == {0, 1}  # both decodes used
            choices = running.proxy.metrics.prefill_choice
            assert choices.get("cold") == 16 and choices.get("cache") == 32
            assert running.proxy.router.queued == {} and running.proxy.router.legs == {}


async def test_a_shared_system_prompt_under_4_kb_is_one_placement():
    shared = system(0, words=300)  # about 2 KB: the old 4 KB key took the user turn in too
    assert len(shared) < 4096
    async with pd_backends(prefills=2) as (pre, dec):
        async with proxy_for(pre, dec) as running:
            for n in range(12):
                reply = await running.request("POST", CHAT, turns(shared, f"user {n} asks " * 6))
                assert reply.status == 200
            assert sorted(len(posts(backend)) for backend in pre) == [0, 12]
        async with proxy_for(pre, dec, prefill_policy="affinity") as running:
            for n in range(12):  # the old key: every conversation its own placement
                await running.request("POST", CHAT, turns(shared, f"other {n} asks " * 6))
            assert min(len(posts(backend)) for backend in pre) > 0


async def test_an_endpoint_leaving_moves_only_its_own_prefixes():
    async with pd_backends(prefills=3) as (pre, dec):
        async with proxy_for(pre, dec) as running:
            for n in range(12):
                assert (await running.request("POST", CHAT, turns(system(n), "a"))).status == 200
            before = {prompt: next(iter(w)) for prompt, w in homes(pre).items()}
            # Ports are ephemeral, so placements vary by run: the busiest one leaves.
            gone = max(range(3), key=lambda i: list(before.values()).count(i))
            assert len(set(before.values())) >= 2
            leaving = next(e for e in running.proxy.prefill.endpoints
                           if e.label == pre[gone].url)
            running.proxy.prefill.remove(leaving, running.proxy.upstream)
            for backend in pre:
                backend.received.clear()
            for n in range(12):
                reply = await running.request("POST", CHAT, turns(system(n), "a", "b"))
                assert reply.status == 200
            after = {prompt: next(iter(w)) for prompt, w in homes(pre).items()}
            for prompt, home in before.items():
                if home != gone:
                    assert after[prompt] == home  # stayed where its cache is
                else:
                    assert after[prompt] != gone


async def test_two_proxies_place_a_cold_prefix_alike():
    async with pd_backends(prefills=4) as (pre, dec):
        async with proxy_for(pre, dec) as one, proxy_for(pre, dec) as two:
            for n in range(10):
                for running in (one, two):  # each sees the prefix cold
                    reply = await running.request("POST", CHAT, turns(system(n), f"q{n}"))
                    assert reply.status == 200
            placed = homes(pre)
            assert len(placed) == 10 and all(len(where) == 1 for where in placed.values())
            assert len({next(iter(w)) for w in placed.values()}) > 1  # not all on one
            assert one.proxy.metrics.prefill_choice.get("cold") == 10
            assert two.proxy.metrics.prefill_choice.get("cold") == 10


async def test_decode_cached_skip_only_after_decode_served_and_under_the_setting():
    async with pd_backends(prefills=1, decodes=2) as (pre, dec):
        async with proxy_for(pre, dec, decode_first_tokens=128) as running:
            legs = running.proxy.metrics.prefill_legs
            first = await running.request("POST", CHAT, turns(system(1), "hello"))
            assert first.status == 200 and len(posts(pre[0])) == 1  # decode held nothing
            served = next(i for i, b in enumerate(dec) if posts(b))
            # Next turn: decode holds all but the answer and a short question.
            second = await running.request("POST", CHAT, turns(system(1), "hello", "short"))
            assert second.status == 200 and len(posts(pre[0])) == 1
            assert legs.get("relay", "skipped", "decode-cached") == 1
            assert len(posts(dec[served])) == 2 and not posts(dec[1 - served])
            assert "kv_transfer_params" not in posts(dec[served])[-1].body
            # A long new turn (above 128 estimated tokens) gets its prefill leg.
            long = "a much longer question " * 40
            third = await running.request("POST", CHAT,
                                          turns(system(1), "hello", "short", long))
            assert third.status == 200 and len(posts(pre[0])) == 2
            # Another conversation: no decode served it, so no skip.
            other = await running.request("POST", CHAT, turns(system(2), "hello"))
            assert other.status == 200 and len(posts(pre[0])) == 3
            assert legs.get("relay", "skipped", "decode-cached") == 1
        async with proxy_for(pre, dec) as running:  # the setting at its default, 0: never
            await running.request("POST", CHAT, turns(system(3), "hello"))
            await running.request("POST", CHAT, turns(system(3), "hello", "short"))
            assert running.proxy.metrics.prefill_legs.get("relay", "skipped",
                                                          "decode-cached") == 0


class _ConfiguredButNone:
    """A prefill choice that is configured but finds no endpoint (the planner's input)."""

    configured = True

    def __call__(self) -> None:
        return None


async def test_decode_cached_is_never_planned_under_sglang():
    body = turns(system(1), "hello")
    for protocol, expected in (("sglang", None), ("relay", "decode-cached")):
        config = Config(kv_protocol=protocol, decode_first_tokens=64)
        request = Generation("chat", b"/v1/chat/completions", b"/v1/chat/completions", body,
                             None, decode_cached=True)
        plan = await plan_generation(config, None, Ids(), request,  # type: ignore[arg-type]
                                     _ConfiguredButNone())
        assert plan.skip_reason == expected, protocol


def engine_load(running: Any, role: str, endpoint: str, metric: str) -> float | None:
    for labels, value in running.proxy.engine_loads.gauges():
        if labels == (role, endpoint, metric):
            return value
    return None


async def test_engine_metrics_are_read_used_and_a_silent_backend_tolerated():
    async with pd_backends(prefills=2, decodes=2) as (pre, dec):
        dec[0].load.in_flight = 40  # an engine busy with another replica's requests
        silent = pre[1]
        served = silent._get

        async def no_metrics(path: str, responder: Any) -> None:
            if path == "/metrics":
                await responder.send_json(404, {"detail": "Not Found"})
            else:
                await served(path, responder)
        silent._get = no_metrics  # type: ignore[method-assign]
        silent.load.orca_header = lambda wanted: []  # type: ignore[method-assign]
        async with proxy_for(pre, dec, health_interval=0.1) as running:
            proxy = running.proxy
            await wait_until(lambda: engine_load(running, "decode", dec[0].url, "running")
                             == 40, 10, "decode /metrics read")
            assert engine_load(running, "decode", dec[1].url, "running") == 0
            await wait_until(lambda: any(e.label == silent.url
                                         for e in proxy.engine_loads.silent), 10, "silent")
            assert engine_load(running, "prefill", silent.url, "waiting") is None
            for n in range(6):
                reply = await running.request("POST", CHAT, turns(system(n), "hi"))
                assert reply.status == 200
            # Used: every decode leg avoided the busy engine.
            assert not posts(dec[0]) and len(posts(dec[1])) == 6
            # Prefill legs asked for ORCA; the demo answered, the silent one too.
            asked = [r for b in pre for r in posts(b)]
            assert len(asked) == 6
            assert all(r.header("endpoint-load-metrics-format") == b"TEXT" for r in asked)
            if posts(pre[0]):  # the demo answered with an ORCA report: it was kept
                assert engine_load(running, "prefill", pre[0].url, "waiting") == 0
            assert engine_load(running, "prefill", silent.url, "waiting") is None
            metrics = (await request(running.port, "GET", "/metrics")).body.decode()
            assert (f'lowproxy_endpoint_engine_load{{role="decode",endpoint="{dec[0].url}",'
                    f'metric="running"}} 40') in metrics


async def test_two_proxies_spill_alike_along_the_rendezvous_order():
    async with pd_backends(prefills=4) as (pre, dec):
        urls = [backend.url for backend in pre]
        salts = {url: label_salt(url) for url in urls}
        busy = 0
        # Prefixes whose home is the busy prefill, and where each goes next.
        prompts = [system(n) for n in range(200)]
        firsts = {prompt: prompt_blocks("chat", turns(prompt, "q"), 512).first
                  for prompt in prompts}
        mine = [p for p in prompts if ranked(urls, salts, firsts[p])[0] == urls[busy]][:8]
        after = {p: urls.index(ranked(urls, salts, firsts[p])[1]) for p in mine}
        assert len(set(after.values())) > 1  # a least-loaded spill would pick one
        # The busy engine reports a long queue (another replica's requests, say):
        # both proxies read it (/metrics, ORCA), neither of them sent it anything.
        pre[busy].load.waiting = 60
        async with proxy_for(pre, dec, health_interval=0.1) as one, \
                proxy_for(pre, dec, health_interval=0.1) as two:
            for running in (one, two):
                await wait_until(lambda r=running: engine_load(r, "prefill", urls[busy],
                                                               "waiting") == 60,
                                 10, "the busy engine's queue read")
            for prompt in mine:
                for running in (one, two):
                    reply = await running.request("POST", CHAT, turns(prompt, "q"))
                    assert reply.status == 200
            placed = homes(pre)
            assert not posts(pre[busy])
            for prompt in mine:
                assert placed[prompt] == {after[prompt]}, prompt[:8]  # both proxies alike
            for running in (one, two):
                assert running.proxy.metrics.prefill_choice.get("load") == len(mine)


async def test_two_proxies_taking_turns_place_busy_groups_alike_and_balanced():
    async with pd_backends(prefills=4) as (pre, dec):
        async with proxy_for(pre, dec) as one, proxy_for(pre, dec) as two:
            groups = [system(n) for n in range(8)]
            # 32 requests each (Placement assigns every 32), every group 4 times.
            for round_ in range(4):
                for prompt in groups:
                    for running in (one, two):
                        reply = await running.request(
                            "POST", CHAT, turns(prompt, f"{round_} {running.port}"))
                        assert reply.status == 200
            placed = one.proxy.router.placement.homes
            assert placed and placed == two.proxy.router.placement.homes
            firsts = {prompt: prompt_blocks("chat", turns(prompt, "x"), 512).first
                      for prompt in groups}
            assert all(len(placed[firsts[prompt]]) == 1 for prompt in groups)
            # Equal shares, (1 + 0.25) x the mean per endpoint: two groups each.
            per = [sum(1 for prompt in groups if placed[firsts[prompt]][0] == backend.url)
                   for backend in pre]
            assert per == [2, 2, 2, 2]
            for backend in pre:
                backend.received.clear()
            for prompt in groups:
                for running in (one, two):
                    reply = await running.request("POST", CHAT, turns(prompt, "more"))
                    assert reply.status == 200
            where = homes(pre)
            for prompt in groups:  # both proxies sent it to its placed home
                assert where[prompt] == {[b.url for b in pre].index(placed[firsts[prompt]][0])}


async def test_an_endpoint_leaving_moves_only_its_own_placed_groups():
    async with pd_backends(prefills=3) as (pre, dec):
        async with proxy_for(pre, dec) as running:
            router = running.proxy.router
            groups = [system(n) for n in range(6)]
            firsts = {prompt: prompt_blocks("chat", turns(prompt, "x"), 512).first
                      for prompt in groups}
            for round_ in range(6):  # 36 requests: placed once (every 32)
                for prompt in groups:
                    reply = await running.request("POST", CHAT, turns(prompt, f"r{round_}"))
                    assert reply.status == 200
            before = {prompt: router.placement.homes[firsts[prompt]] for prompt in groups}
            assert all(len(where) == 1 for where in before.values())
            urls = [backend.url for backend in pre]
            gone = max(urls, key=lambda url: sum(where == (url,) for where in before.values()))
            leaving = next(e for e in running.proxy.prefill.endpoints if e.label == gone)
            running.proxy.prefill.remove(leaving, running.proxy.upstream)
            for round_ in range(6):  # placed again, on two endpoints
                for prompt in groups:
                    reply = await running.request("POST", CHAT, turns(prompt, f"s{round_}"))
                    assert reply.status == 200
            for backend in pre:
                backend.received.clear()
            for prompt in groups:
                reply = await running.request("POST", CHAT, turns(prompt, "t"))
                assert reply.status == 200
            where = homes(pre)
            for prompt in groups:
                after = router.placement.homes[firsts[prompt]]
                assert gone not in after and where[prompt] == {urls.index(after[0])}
                if before[prompt] != (gone,):
                    assert after == before[prompt]  # stayed where its cache is


async def test_one_prefill_endpoint_asks_for_no_orca_report():
    # A report can only inform a choice between prefill endpoints: with one there is
    # none, and the engine would compute a report for every leg for nothing.
    async with pd_backends(prefills=1, decodes=1) as (pre, dec):
        async with proxy_for(pre, dec) as running:
            assert running.proxy.dispatch.engine_loads is not None  # cache-aware is on
            reply = await running.request("POST", CHAT, turns(system(0), "hi"))
            assert reply.status == 200
            asked = posts(pre[0])
            assert len(asked) == 1
            assert asked[0].header("endpoint-load-metrics-format") is None
