"""PD_PROXY_PEERS over real sockets: two proxies told each other's prefill choices keep a
conversation on one prefill after a spill (without peers the same turns split), a peer
that is down costs no errors and leaks nothing, the admin key is required when set, a
replica reaching itself ignores its own batches, and a bad setting stops the start."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator

import pytest

from helpers import Daemon, config_for, free_port, pd_backends, request, wait_until
from helpers.conversation import CHAT, legs_at, turns
from lowproxy.config import parse_endpoint
from lowproxy.daemon import limits_of
from lowproxy.downstream import HttpServer
from lowproxy.proxy import Proxy
from lowproxy.routing.blocks import hash_probe
from lowproxy.routing.peer_batch import encode
from lowproxy.routing.peers import MAX_BODY_BYTES, PEERS_PATH

KEY = "peer-admin-key-7f3a"


@contextlib.asynccontextmanager
async def proxy_on(config: Any, resolver: Any = None) -> AsyncIterator[Proxy]:
    """A proxy in this process on the port its config names (chosen beforehand: its
    peers name it)."""
    proxy = Proxy(config, resolver=resolver)
    await proxy.start()
    server = HttpServer(proxy.handle, limits_of(config))
    await server.listen("127.0.0.1", config.port)
    try:
        yield proxy
    finally:
        await server.drain(0)
        await proxy.close()


def replica_config(pre: list[Any], dec: list[Any], peers: list[int], **overrides: Any) -> Any:
    overrides.setdefault("port", free_port())
    return config_for([b.url for b in pre], [b.url for b in dec], prefill_policy="cache-aware",
                      peers=tuple(parse_endpoint(f"http://127.0.0.1:{p}") for p in peers),
                      **overrides)


def received(proxy: Proxy) -> float:
    return proxy.metrics.peer_records_received.get("recorded")


@pytest.mark.parametrize("shared", [True, False])
async def test_turns_alternating_between_replicas_stay_on_one_prefill_after_a_spill(shared):
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        ports = [free_port(), free_port()]
        configs = [replica_config(pre, dec, [ports[1 - n]] if shared else [],
                                  admin_api_key=KEY, port=ports[n]) for n in range(2)]
        async with proxy_on(configs[0]) as a, proxy_on(configs[1]) as b:
            said = ["first question " * 20]

            async def turn(proxy: Proxy, port: int) -> int:
                """One turn through ``proxy``: the prefill that took it (0 or 1)."""
                before = [legs_at(p) for p in pre]
                seen = received(b if proxy is a else a)
                reply = await request(port, "POST", CHAT, turns(*said))
                assert reply.status == 200, reply.body
                said.append(f"question {len(said)} " * 20)
                took = [legs_at(p) - n for p, n in zip(pre, before, strict=True)].index(1)
                if shared:  # the other replica has heard of this leg before the next turn
                    await wait_until(lambda: received(b if proxy is a else a) > seen,
                                     what="the peer's batch")
                return took

            home = await turn(b, ports[1])  # cold: the rendezvous order's first
            # A believes home swamped (as when its own legs queue there): its next turn
            # spills to the other prefill, which then holds the conversation's latest turn.
            assert a.router is not None
            a.router.queued[a.prefill.endpoints[home]] = 1e9
            spilled = await turn(a, ports[0])
            assert spilled == 1 - home
            del a.router.queued[a.prefill.endpoints[home]]
            later = [await turn(b, ports[1]), await turn(a, ports[0]), await turn(b, ports[1])]
            if shared:
                # B heard of A's spill: the conversation follows its latest copy.
                assert later == [spilled] * 3
                assert a.metrics.peer_batches_sent.get(f"http://127.0.0.1:{ports[1]}") >= 2
            else:
                # B knows only its own first turn: back to home, the cache split in two.
                assert later[0] == home and spilled != home
            for proxy in (a, b):
                assert proxy.router is not None and proxy.router.queued == {}


async def test_a_peer_that_is_down_costs_no_errors_and_no_leak(caplog):
    caplog.set_level(logging.INFO, logger="lowproxy.peers")
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        down = free_port()  # nothing listens there yet
        config = replica_config(pre, dec, [down])
        peer_label = f"http://127.0.0.1:{down}"
        async with proxy_on(config) as listening:
            share = listening.peers
            assert share is not None
            for n in range(12):
                body = turns(f"question {n} " * 20)
                reply = await request(_port_of(listening), "POST", CHAT, body)
                assert reply.status == 200, reply.body
            await wait_until(lambda: listening.metrics.peer_send_failures.get(
                peer_label, "unreachable") >= 1, what="a failed send")
            peer = share.group.endpoints[0]
            await wait_until(lambda: not share.sending, what="no send in flight")
            assert peer.in_flight == 0 and peer.open == 0 and len(share.outbox) <= 12
            assert listening.metrics.peer_records_dropped.get(peer_label) >= 1
            scraped = (await request(config.port, "GET", "/metrics")).body.decode()
            assert f'lowproxy_peer_up{{peer="{peer_label}"}} 0' in scraped
            down_lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(down_lines) == 1 and peer_label in down_lines[0].getMessage()
            assert down_lines[0].levelno == logging.WARNING
            # It comes up: the next batch after the retry pause gets through, said once.
            async with proxy_on(replica_config(pre, dec, [config.port], port=down)):
                async def one_more() -> None:
                    reply = await request(_port_of(listening), "POST", CHAT,
                                          turns("again " * 30))
                    assert reply.status == 200
                deadline = time.monotonic() + 10  # RETRY_SECONDS after the last failure
                while not listening.metrics.peer_batches_sent.get(peer_label) \
                        and time.monotonic() < deadline:
                    await one_more()
                    await asyncio.sleep(0.02)
                assert listening.metrics.peer_batches_sent.get(peer_label) >= 1
                up_lines = [r for r in caplog.records if "answers again" in r.getMessage()]
                assert len(up_lines) == 1 and peer_label in up_lines[0].getMessage()
            assert dict(share.up()) == {(peer_label,): 1.0}


def _port_of(proxy: Proxy) -> int:
    return proxy.config.port


async def test_the_admin_key_is_required_when_set_and_bad_bodies_are_4xx(caplog):
    caplog.set_level(logging.DEBUG)
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        port = free_port()
        config = replica_config(pre, dec, [free_port()], admin_api_key=KEY, port=port)
        async with proxy_on(config) as proxy:
            label = proxy.prefill.endpoints[0].label
            chain = [11, -22, 33]
            body = encode(7, hash_probe(512), 512, [(label, chain), ("http://other:1", [5])])
            for headers in ([], [("x-admin-api-key", "wrong")]):
                reply = await request(port, "POST", PEERS_PATH, raw_body=body, headers=headers)
                assert reply.status == 403 and reply.json() == {"error": "forbidden"}
            assert proxy.router is not None and proxy.router.prefills.match(label, chain) == 0
            good = [("x-admin-api-key", KEY)]
            reply = await request(port, "POST", PEERS_PATH, raw_body=body, headers=good)
            assert reply.status == 200 and reply.json() == {"status": "ok", "recorded": 1}
            assert proxy.router.prefills.match(label, chain) == 3  # as if sent from here
            assert proxy.router.queued == {} and proxy.router.legs == {}  # no work queued
            assert proxy.metrics.peer_records_received.get("unknown") == 1
            reply = await request(port, "POST", PEERS_PATH, raw_body=b"not a batch", headers=good)
            assert reply.status == 400 and "batch" in reply.json()["error"]["message"]
            huge = b"\0" * (MAX_BODY_BYTES + 1)
            reply = await request(port, "POST", PEERS_PATH, raw_body=huge, headers=good)
            assert reply.status == 413 and reply.json()["error"]["type"] == "invalid_request"
            other_size = encode(7, hash_probe(256), 256, [(label, chain)])
            reply = await request(port, "POST", PEERS_PATH, raw_body=other_size,
                                  headers=good)
            assert reply.status == 409 and reply.json()["error"]["type"] == "peer_mismatch"
            reply = await request(port, "GET", PEERS_PATH, headers=good)
            assert reply.status == 405
    assert KEY not in caplog.text


async def test_a_replica_reaching_itself_by_a_dns_name_ignores_its_own_batches():
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        port = free_port()

        async def resolver(host: str, port: int) -> list[str]:
            assert host == "peers.test"
            return ["127.0.0.1"]

        config = config_for([b.url for b in pre], [b.url for b in dec],
                            prefill_policy="cache-aware", port=port,
                            peers=(parse_endpoint(f"dns+http://peers.test:{port}"),))
        async with proxy_on(config, resolver) as proxy:
            share = proxy.peers
            assert share is not None
            label = f"http://127.0.0.1:{port}"
            assert [e.label for e in share.group.endpoints] == [label]
            reply = await request(port, "POST", CHAT, turns("hello " * 40))
            assert reply.status == 200
            await wait_until(lambda: share.own, what="the replica to know itself")
            assert proxy.metrics.peer_batches_received.get("own") == 1
            assert proxy.metrics.peer_records_received.get("recorded") == 0
            for _ in range(3):
                assert (await request(port, "POST", CHAT, turns("more " * 40))).status == 200
            share.flush()
            await wait_until(lambda: not share.sending, what="no send in flight")
            assert proxy.metrics.peer_batches_received.get("own") == 1  # not sent again
            assert list(share.up()) == []


@pytest.mark.parametrize("env", [
    {"PD_PROXY_PEERS": "ftp://127.0.0.1:9"},
    {"PD_PROXY_PEERS": "http://127.0.0.1:9#bootstrap_port=1"},
    {"PD_PROXY_PEERS": "http://127.0.0.1:9", "PD_PROXY_PREFILL_POLICY": "round-robin"},
])
def test_a_peers_mistake_stops_the_start_naming_the_setting(env):
    daemon = Daemon([], {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(free_port()),
                         "PD_PROXY_DECODE_URL": "http://127.0.0.1:9", **env})
    assert daemon.proc.wait(30) == 2
    lines = [line for line in daemon.output().splitlines() if line.strip()]
    assert len(lines) == 1 and "PD_PROXY_PEERS" in lines[0], lines


def _unstarted_proxy_with_a_peer() -> Proxy:
    """Two prefills, cache-aware, one peer; not started, so nothing is sent."""
    return Proxy(config_for(["http://127.0.0.1:1", "http://127.0.0.1:2"], "http://127.0.0.1:3",
                            prefill_policy="cache-aware",
                            peers=(parse_endpoint("http://127.0.0.1:4"),)))


async def test_choices_beyond_a_batch_and_batches_for_a_busy_peer_are_dropped_not_queued():
    from lowproxy.routing.peers import MAX_RECORDS

    proxy = _unstarted_proxy_with_a_peer()  # nothing is sent
    share = proxy.peers
    assert share is not None and proxy.router is not None
    assert proxy.router.shared == share.note and proxy.router.stable
    for n in range(MAX_RECORDS + 952):
        share.note("http://127.0.0.1:1", [n, n + 1])
    assert len(share.outbox) == MAX_RECORDS and share.lost == 952
    peer = share.group.endpoints[0]
    share.retry_at[peer] = float("inf")  # failed just now: this batch is not for it
    share.flush()
    assert share.outbox == [] and share.lost == 0 and not share.sending
    assert proxy.metrics.peer_records_dropped.get(peer.label) == MAX_RECORDS + 952
    await proxy.close()


async def test_without_peers_nothing_is_noted_and_keys_stay_per_process():
    config = config_for(["http://127.0.0.1:1", "http://127.0.0.1:2"], "http://127.0.0.1:3",
                        prefill_policy="cache-aware")
    proxy = Proxy(config)
    assert proxy.peers is None and proxy.router is not None
    assert proxy.router.shared is None and not proxy.router.stable
    assert b"lowproxy_peer" not in proxy.metrics.render()
    await proxy.close()


def test_peers_with_workers_say_at_start_that_workers_are_not_covered():
    daemon = Daemon(["--workers", "2"], {
        "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(free_port()),
        "PD_PROXY_DECODE_URL": "http://127.0.0.1:9", "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0",
        "PD_PROXY_PEERS": f"http://127.0.0.1:{free_port()}"})
    try:
        daemon.wait_listening()
    finally:
        assert daemon.stop() == 0
    warned = [line for line in daemon.output().splitlines() if "PD_PROXY_PEERS with" in line]
    assert len(warned) == 1 and "2 workers" in warned[0], daemon.output()


async def test_a_flush_is_armed_by_a_choice_and_only_then():
    """No choice, no wake-up: the first choice since a flush arms the next one."""
    proxy = _unstarted_proxy_with_a_peer()  # the share alone
    share = proxy.peers
    assert share is not None
    share.start(asyncio.get_running_loop())
    assert share._flush_timer is None
    share.note("http://127.0.0.1:1", [1, 2])
    timer = share._flush_timer
    assert timer is not None
    share.note("http://127.0.0.1:1", [3])
    assert share._flush_timer is timer  # one flush for the batch
    share.retry_at[share.group.endpoints[0]] = float("inf")  # nothing is sent
    await asyncio.sleep(0.1)
    assert share._flush_timer is None and share.outbox == []
    await proxy.close()
