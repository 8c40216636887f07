"""Pure pieces of the handshakes and of backend choice, without sockets."""

from __future__ import annotations

import asyncio
import json

import pytest

from lowproxy.config import ConfigError, EndpointSpec, load_config, parse_endpoint
from lowproxy.handshakes import bootstrap
from lowproxy.handshakes.bootstrap import (
    BootstrapCache,
    BootstrapError,
    EngineMap,
    parse_query_answer,
)
from lowproxy.handshakes.legs import mooncake_bodies, sglang_body
from lowproxy.routing.groups import BackendGroup, PrefillTargetAllowList, split_host_port
from lowproxy.upstream import Endpoint

CLIENT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
          "stream_options": {"include_usage": True}, "max_tokens": 50,
          "max_completion_tokens": 40, "min_tokens": 3, "temperature": 0.2}


# -- mooncake_bodies


def test_mooncake_prefill_body_is_primed_and_carries_the_transfer_id():
    prefill, _ = mooncake_bodies(dict(CLIENT), "xfer-1", "eng_dp0", "http://10.0.0.5:8998")
    assert prefill == {"model": "m", "messages": CLIENT["messages"], "stream": False,
                       "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.2,
                       "ignore_eos": True,
                       "kv_transfer_params": {"do_remote_decode": True,
                                              "do_remote_prefill": False,
                                              "transfer_id": "xfer-1"}}


def test_mooncake_decode_body_is_the_clients_plus_the_full_kv_dict():
    client = dict(CLIENT)
    _, decode = mooncake_bodies(client, "xfer-1", "eng_dp1", "http://10.0.0.5:9000")
    assert decode == {**CLIENT, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-1",
        "remote_engine_id": "eng_dp1", "remote_bootstrap_addr": "http://10.0.0.5:9000"}}
    assert client == CLIENT  # the client's body is not changed in place


def test_mooncake_without_max_completion_tokens_sets_only_max_tokens():
    prefill, decode = mooncake_bodies({"prompt": "x"}, "t", "e", "http://h:1")
    assert prefill["max_tokens"] == 1 and "max_completion_tokens" not in prefill
    assert "max_tokens" not in decode and "stream" not in decode


# -- sglang_body


def test_sglang_body_adds_the_three_fields_and_caps_nothing():
    client = dict(CLIENT)
    shaped = sglang_body(client, "10.0.0.5", 8998, 2 ** 63 - 1)
    assert shaped == {**CLIENT, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998,
                      "bootstrap_room": 2 ** 63 - 1}
    assert client == CLIENT
    assert json.loads(json.dumps(shaped))["bootstrap_room"] == 9223372036854775807


def test_sglang_fields_override_client_supplied_ones():
    shaped = sglang_body({"prompt": "x", "bootstrap_host": "evil", "bootstrap_room": -1},
                         "10.0.0.5", 7000, 5)
    assert (shaped["bootstrap_host"], shaped["bootstrap_port"], shaped["bootstrap_room"]) == \
        ("10.0.0.5", 7000, 5)


# -- the bootstrap answer


def test_parse_query_answer_keeps_engine_ids_by_rank():
    raw = json.dumps({"0": {"engine_id": "a_dp0", "worker_addr": {"0": {"0": "tcp://x:1"}}},
                      "1": {"engine_id": "a_dp1"}}).encode()
    assert parse_query_answer(raw) == {"0": "a_dp0", "1": "a_dp1"}


def test_parse_query_answer_skips_entries_without_a_usable_engine_id():
    raw = json.dumps({"0": {"engine_id": ""}, "1": {"engine_id": 5}, "2": "x",
                      "3": {"engine_id": "ok"}}).encode()
    assert parse_query_answer(raw) == {"3": "ok"}


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1,2]", b"{}", b'{"0": {}}',
                                 b'{"0": {"engine_id": null}}', b"\xff\xfe"])
def test_parse_query_answer_rejects_unusable_answers(raw):
    with pytest.raises(BootstrapError):
        parse_query_answer(raw)


def test_engine_map_spreads_over_ranks_in_numeric_order():
    engines = EngineMap({"10": "e10", "2": "e2", "0": "e0", "1": "e1"})
    picks = [engines.next_rank() for _ in range(8)]
    assert [rank for rank, _ in picks] == ["0", "1", "2", "10"] * 2
    assert all(engine == "e" + rank for rank, engine in picks)


def test_bootstrap_addr_uses_the_endpoint_override_and_brackets_ipv6():
    cache = BootstrapCache(upstream=None, default_port=8998)  # type: ignore[arg-type]
    assert cache.bootstrap_addr(Endpoint(parse_endpoint("http://10.0.0.5:8000"))) == \
        "http://10.0.0.5:8998"
    v6 = Endpoint(parse_endpoint("http://[fd00::5]:8000#bootstrap_port=9"))
    assert cache.bootstrap_addr(v6) == "http://[fd00::5]:9"
    # A discovered endpoint meets at its address, not at the service name.
    spec = parse_endpoint("dns+http://prefill.svc:8000")
    assert cache.bootstrap_addr(Endpoint(spec, "10.1.2.3")) == "http://10.1.2.3:8998"


# -- split_host_port and the allowlist


@pytest.mark.parametrize("text, expected", [
    ("10.0.0.5:8000", ("10.0.0.5", 8000)),
    (" Prefill.SVC:80 ", ("prefill.svc", 80)),
    ("prefill", ("prefill", None)),
    ("[fd00::1]:8000", ("fd00::1", 8000)),
    ("[fd00::1]", ("fd00::1", None)),
    ("fd00::1", ("fd00::1", None)),
    ("host:", ("host", None)),
])
def test_split_host_port(text, expected):
    assert split_host_port(text) == expected


@pytest.mark.parametrize("text", ["host:0", "host:65536", "host:http", "host:+80", "host:8_0",
                                  "host:-1", "[::1]:x"])
def test_split_host_port_rejects_bad_ports(text):
    with pytest.raises(ValueError):
        split_host_port(text)


def test_allowlist_by_host_host_port_and_cidr():
    allow = PrefillTargetAllowList(["prefill.svc", "10.0.0.5:8000", "192.168.0.0/16",
                                    "fd00::/64"])
    assert allow.enabled
    assert allow.allows("prefill.svc", 1234)  # a host entry allows any port
    assert allow.allows("10.0.0.5", 8000) and not allow.allows("10.0.0.5", 8001)
    assert allow.allows("192.168.7.9", 80) and not allow.allows("192.169.0.1", 80)
    assert allow.allows("fd00::1234", 80) and not allow.allows("fd01::1", 80)
    # No resolution and no lenient IPv4 forms: "127.1" is not 127.0.0.1 to a CIDR.
    assert not PrefillTargetAllowList(["127.0.0.0/8"]).allows("127.1", 80)
    assert not PrefillTargetAllowList(["127.0.0.0/8"]).allows("localhost", 80)
    assert not allow.allows("evil.example", 80)
    assert not allow.allows("::ffff:192.168.0.1", 80)  # mapped v6 is not the v4 network


def test_empty_allowlist_is_disabled():
    assert not PrefillTargetAllowList([]).enabled


# -- balancing choices


def group(*urls: str) -> BackendGroup:
    return BackendGroup("decode", [parse_endpoint(u) for u in urls])


def test_least_loaded_with_round_robin_ties():
    backends = group("http://a:1", "http://b:1", "http://c:1")
    a, b, c = backends.endpoints
    assert [backends.pick_least_loaded() for _ in range(3)] == [a, b, c]
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    picks = [backends.pick_least_loaded() for _ in range(4)]
    assert a not in picks and {b, c} == set(picks)
    backends.cool_down(b)
    assert {backends.pick_least_loaded() for _ in range(3)} == {c}
    assert backends.pick_least_loaded(exclude=(c,)) is a


def test_round_robin_skips_cooling_endpoints_and_none_when_all_cool():
    backends = group("http://a:1", "http://b:1")
    a, b = backends.endpoints
    backends.cool_down(a)
    assert [backends.pick_round_robin() for _ in range(3)] == [b, b, b]
    backends.cool_down(b)
    assert backends.pick_round_robin() is None and backends.pick_least_loaded() is None
    assert backends.in_cooldown() == 2 and backends.usable_count() == 0


async def test_discovery_keeps_pools_of_addresses_that_remain():
    backends = BackendGroup("decode", [parse_endpoint("dns+http://svc:80")])
    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"]]

    async def resolver(host, port):
        assert (host, port) == ("svc", 80)
        return answers.pop(0)

    class Pools:
        closed: list = []

        def close_idle(self, endpoint):
            self.closed.append(endpoint.connect_host)

    pools = Pools()
    await backends.refresh(resolver, pools)  # type: ignore[arg-type]
    first = {e.connect_host: e for e in backends.endpoints}
    assert set(first) == {"10.0.0.1", "10.0.0.2"}
    assert all(e.server_hostname == "svc" and e.host_header == b"svc:80" for e in first.values())
    await backends.refresh(resolver, pools)  # type: ignore[arg-type]
    second = {e.connect_host: e for e in backends.endpoints}
    assert set(second) == {"10.0.0.2", "10.0.0.3"}
    assert second["10.0.0.2"] is first["10.0.0.2"]  # same endpoint, same pool
    assert pools.closed == ["10.0.0.1"]


# -- configuration of these features


def test_several_backends_from_env_and_repeated_flags():
    config, _ = load_config([], {"PD_PROXY_PREFILL_URL":
                                 "http://p1:1, http://p2:2#bootstrap_port=9",
                                 "PD_PROXY_DECODE_URL": "http://d1:1,dns+http://d.svc:2",
                                 "PD_PROXY_KV_PROTOCOL": "mooncake",
                                 "PD_PROXY_PREFILL_HEADER_ALLOW": "10.0.0.0/8, p1:1"})
    assert [s.host for s in config.prefill] == ["p1", "p2"]
    assert config.prefill[1].bootstrap_port == 9
    assert config.decode[1] == EndpointSpec("http", "d.svc", 2, discover=True)
    assert config.kv_protocol == "mooncake"
    assert config.prefill_header_allow == ("10.0.0.0/8", "p1:1")
    config, _ = load_config(["--decode", "http://a:1", "--decode", "http://b:2",
                             "--kv-protocol", "sglang"], {"PD_PROXY_DECODE_URL": "http://c:3"})
    assert [s.host for s in config.decode] == ["a", "b"] and config.kv_protocol == "sglang"


@pytest.mark.parametrize("argv", [["--kv-protocol", "nixl"],
                                  ["--prefill-header-allow", "host:port"],
                                  ["--prefill-header-allow", "10.0.0.0/40"],
                                  ["--prefill", "http://p:1#bootstrap=9"],
                                  ["--on-prefill-failure", "retry"]])
def test_bad_settings_stop_the_start(argv):
    with pytest.raises(ConfigError):
        load_config(argv, {})


# -- the bootstrap cache


class _FakeQueries:
    """Stands in for BootstrapCache._fetch: counts queries, answers or fails on cue."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail = False
        self.gate: asyncio.Event | None = None

    async def __call__(self, endpoint: Endpoint) -> EngineMap:
        self.calls.append(endpoint.label)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise BootstrapError("down")
        return EngineMap({"0": f"{endpoint.label}_dp0"})


def _cache(monkeypatch, entries: int = 1024) -> tuple[BootstrapCache, _FakeQueries]:
    monkeypatch.setattr(bootstrap, "CACHE_ENTRIES", entries)
    cache = BootstrapCache(upstream=None, default_port=8998)  # type: ignore[arg-type]
    fake = _FakeQueries()
    monkeypatch.setattr(cache, "_fetch", fake)
    return cache, fake


async def test_bootstrap_cache_is_bounded_and_drops_the_least_recently_learned(monkeypatch):
    """Reading a map costs a request no reordering: maps in use are learned again
    every refresh period, so the oldest learned is the one to go."""
    cache, fake = _cache(monkeypatch, entries=2)
    a, b, c = (Endpoint(parse_endpoint(f"http://{h}:1")) for h in "abc")
    await cache.engines(a)
    await cache.engines(b)
    await cache.engines(a)  # read from the cache: a is still the oldest learned
    await cache.engines(c)  # evicts a
    assert len(cache) == 2 and fake.calls == [a.label, b.label, c.label]
    await cache.engines(b)
    await cache.engines(a)
    assert fake.calls[-1] == a.label and fake.calls.count(b.label) == 1


async def test_bootstrap_concurrent_callers_share_one_query(monkeypatch):
    cache, fake = _cache(monkeypatch)
    fake.gate = asyncio.Event()
    endpoint = Endpoint(parse_endpoint("http://p:1"))
    waiters = [asyncio.ensure_future(cache.engines(endpoint)) for _ in range(5)]
    await asyncio.sleep(0)
    waiters[0].cancel()  # one client leaving does not cancel the others' query
    fake.gate.set()
    results = await asyncio.gather(*waiters[1:])
    assert fake.calls == [endpoint.label]
    assert all(r is results[0] for r in results)


async def test_bootstrap_failure_is_held_not_cached_and_forget_queries_again(monkeypatch):
    monkeypatch.setattr(bootstrap, "HOLD_SECONDS", 0.0)
    cache, fake = _cache(monkeypatch)
    endpoint = Endpoint(parse_endpoint("http://p:1"))
    fake.fail = True
    for _ in range(2):
        with pytest.raises(BootstrapError):
            await cache.engines(endpoint)  # the second: the held failure, asked again after
    await asyncio.sleep(0.01)
    assert len(cache) == 0 and len(fake.calls) == 2
    fake.fail = False
    with pytest.raises(BootstrapError):
        await cache.engines(endpoint)  # held again: it asks in the background
    await asyncio.sleep(0.01)
    await cache.engines(endpoint)
    await cache.engines(endpoint)
    assert len(fake.calls) == 3
    cache.forget(endpoint)
    await cache.engines(endpoint)
    assert len(fake.calls) == 4


def test_handshake_defaults():
    config, _ = load_config([], {})
    assert config.kv_protocol == "relay" and config.on_prefill_failure == "recompute"
    assert config.mooncake_bootstrap_port == 8998 and config.sglang_bootstrap_port == 8998
    assert config.prefill_header_allow == ()
    config, _ = load_config([], {"PD_PROXY_MOONCAKE_BOOTSTRAP_PORT": "9001",
                                 "PD_PROXY_SGLANG_BOOTSTRAP_PORT": "9002",
                                 "PD_PROXY_ON_PREFILL_FAILURE": "error",
                                 "PD_PROXY_DNS_REFRESH_SECONDS": "2.5",
                                 "PD_PROXY_PREFILL_TIMEOUT_SECONDS": "7"})
    assert (config.mooncake_bootstrap_port, config.sglang_bootstrap_port) == (9001, 9002)
    assert config.on_prefill_failure == "error" and config.dns_refresh == 2.5
    assert config.prefill_timeout == 7.0


async def test_a_cached_map_is_found_without_a_query_and_carries_its_bootstrap_addr(monkeypatch):
    cache, fake = _cache(monkeypatch)
    endpoint = Endpoint(parse_endpoint("http://10.0.0.5:8000#bootstrap_port=9"))
    assert cache.cached(endpoint) is None and fake.calls == []  # looking does not query
    engines = await cache.engines(endpoint)
    assert engines.bootstrap_addr == cache.bootstrap_addr(endpoint) == "http://10.0.0.5:9"
    assert cache.cached(endpoint) is engines and fake.calls == [endpoint.label]
    cache.forget(endpoint)
    assert cache.cached(endpoint) is None


def test_a_transfer_id_is_the_next_hex_id_in_uuid4_shape():
    from lowproxy.ids import Ids

    ids = Ids()
    first = ids.next_hex()  # the counter's 1
    h = first[:16] + f"{2:016x}"  # what next_hex() would give next
    variant = "89ab"[int(h[16], 16) & 3]
    assert ids.next_uuid() == f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{variant}{h[17:20]}-{h[20:]}"
