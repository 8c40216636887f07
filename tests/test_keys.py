"""Keys: the backend key on every leg, forwarded authorization, client keys, no key leaked."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any, AsyncIterator

import pytest

from helpers import (
    Daemon,
    RunningProxy,
    ScriptedBackend,
    chat,
    config_for,
    free_port,
    request,
    running_proxy,
)
from lowproxy.config import ConfigError, load_config
from lowproxy.demo import DemoBackend, start_pair
from lowproxy.keys import ClientKeys, KeySource, bearer_token, matches_any

BACKEND_KEY = "bk-0123456789-backend"
CLIENT_KEY = "ck-abcdef-client"
OTHER_CLIENT_KEY = "ck-second-client"


def authorizations(received: Any) -> list[bytes]:
    return [value for name, value in received.headers if name.lower() == b"authorization"]


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@contextlib.asynccontextmanager
async def keyed_setup(backend_key: str | None = BACKEND_KEY, **overrides: Any
                      ) -> AsyncIterator[tuple[RunningProxy, DemoBackend, DemoBackend]]:
    """Demo backends started with --api-key (when given) and a proxy in front."""
    prefill, decode = await start_pair(api_key=backend_key,
                                       sglang_pd=overrides.get("kv_protocol") == "sglang")
    overrides.setdefault("mooncake_bootstrap_port", prefill.bootstrap_port)
    prefill_url = f"{prefill.url}#bootstrap_port={prefill.bootstrap_port}"
    try:
        async with running_proxy(config_for(prefill_url, decode.url, **overrides)) as running:
            yield running, prefill, decode
    finally:
        await prefill.close()
        await decode.close()


# -- pure: parsing and comparing


@pytest.mark.parametrize("header, token", [
    (b"Bearer abc", b"abc"), (b"bearer abc", b"abc"), (b"BEARER  abc ", b"abc"),
    (b"Basic abc", None), (b"abc", None), (b"Bearer", None), (b"Bearer ", None), (None, None),
])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_matches_any_compares_every_key_exactly():
    keys = (b"one", b"two")
    assert matches_any(b"two", keys) and matches_any(b"one", keys)
    assert not matches_any(b"tw", keys) and not matches_any(b"twoo", keys)
    assert not matches_any(None, keys) and not matches_any(b"one", ())


def _rewrite(path: str, text: str) -> None:
    with open(path + ".new", "w") as file:
        file.write(text)
    os.replace(path + ".new", path)  # a new inode, as a Secret's symlink swap gives


def test_key_file_is_re_read_when_its_identity_changes(tmp_path, caplog):
    path = str(tmp_path / "keys")
    _rewrite(path, "first\n\n second \n")
    source = KeySource(path=path, many=True)
    assert source.keys() == (b"first", b"second")
    _rewrite(path, "third\n")
    assert source.keys() == (b"third",)
    os.remove(path)
    with caplog.at_level(logging.WARNING):
        assert source.keys() == (b"third",)  # unreadable: the last keys read stay
        assert source.keys() == (b"third",)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0].getMessage()
    assert "third" not in caplog.text and "third" not in repr(source)


def test_an_empty_client_key_file_refuses_everyone(tmp_path):
    path = tmp_path / "keys"
    path.write_text("only\n")
    keys = ClientKeys(path=str(path))
    assert keys.allows(b"Bearer only")
    _rewrite(str(path), "\n")
    assert keys.required and not keys.allows(b"Bearer only") and not keys.allows(b"Bearer ")


# -- settings


def load(env: dict[str, str], argv: list[str] | None = None) -> Any:
    return load_config(argv or [], env)[0]


def test_key_settings_parse_from_variables_and_flags(tmp_path):
    config = load({"PD_PROXY_CLIENT_API_KEYS": " a, b ,,", "PD_PROXY_BACKEND_API_KEY": "x"})
    assert config.client_api_keys == ("a", "b") and config.backend_api_key == "x"
    config = load({}, ["--client-api-keys", "c", "--client-api-keys", "d",
                       "--forward-authorization", "1"])
    assert config.client_api_keys == ("c", "d") and config.forward_authorization
    secret = tmp_path / "k"
    secret.write_text("from-file\n")
    assert load({"PD_PROXY_BACKEND_API_KEY_FILE": str(secret)}).backend_api_key_file == str(
        secret)


@pytest.mark.parametrize("env, named", [
    ({"PD_PROXY_BACKEND_API_KEY": BACKEND_KEY, "PD_PROXY_FORWARD_AUTHORIZATION": "1"},
     ("PD_PROXY_BACKEND_API_KEY", "PD_PROXY_FORWARD_AUTHORIZATION")),
    ({"PD_PROXY_BACKEND_API_KEY": BACKEND_KEY, "PD_PROXY_BACKEND_API_KEY_FILE": "/x"},
     ("PD_PROXY_BACKEND_API_KEY", "PD_PROXY_BACKEND_API_KEY_FILE")),
    ({"PD_PROXY_CLIENT_API_KEYS": CLIENT_KEY, "PD_PROXY_CLIENT_API_KEYS_FILE": "/x"},
     ("PD_PROXY_CLIENT_API_KEYS", "PD_PROXY_CLIENT_API_KEYS_FILE")),
    ({"PD_PROXY_BACKEND_API_KEY_FILE": "/nonexistent/key"}, ("PD_PROXY_BACKEND_API_KEY_FILE",)),
    ({"PD_PROXY_CLIENT_API_KEYS_FILE": "/nonexistent/keys"},
     ("PD_PROXY_CLIENT_API_KEYS_FILE",)),
])
def test_contradicting_or_unusable_key_settings_stop_the_start(env, named):
    with pytest.raises(ConfigError) as caught:
        load(env)
    for name in named:
        assert name in str(caught.value)
    assert BACKEND_KEY not in str(caught.value) and CLIENT_KEY not in str(caught.value)


def test_repr_hides_every_key():
    config = load({"ADMIN_API_KEY": "adm-secret", "PD_PROXY_BACKEND_API_KEY": BACKEND_KEY,
                   "PD_PROXY_CLIENT_API_KEYS": f"{CLIENT_KEY},{OTHER_CLIENT_KEY}"})
    shown = repr(config)
    for key in ("adm-secret", BACKEND_KEY, CLIENT_KEY, OTHER_CLIENT_KEY):
        assert key not in shown


def test_daemon_with_both_backend_key_and_forwarding_exits_2_with_one_line():
    daemon = Daemon(["--forward-authorization", "1"], {"PD_PROXY_BACKEND_API_KEY": BACKEND_KEY})
    status = daemon.proc.wait(30)
    out = daemon.output()
    lines = [line for line in out.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, out
    assert "PD_PROXY_BACKEND_API_KEY" in lines[0] and "--forward-authorization" in lines[0]
    assert BACKEND_KEY not in out


# -- the backend key over sockets


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake", "sglang"])
async def test_backend_key_goes_on_both_legs(kv_protocol):
    async with keyed_setup(backend_api_key=BACKEND_KEY, kv_protocol=kv_protocol) as (
            proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat())
        assert reply.status == 200, reply.body
        assert prefill.received and decode.received
        for received in prefill.received + decode.received:
            assert authorizations(received) == [f"Bearer {BACKEND_KEY}".encode()]


async def test_backend_key_goes_with_passthrough_and_replaces_the_clients():
    async with keyed_setup(backend_api_key=BACKEND_KEY) as (proxy, prefill, decode):
        reply = await proxy.request("GET", "/v1/models", headers=bearer("client-own"))
        assert reply.status == 200
        [received] = decode.received
        assert authorizations(received) == [f"Bearer {BACKEND_KEY}".encode()]


async def test_without_a_backend_key_no_authorization_reaches_a_backend():
    async with keyed_setup(backend_key=None) as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=bearer("client-own"))
        assert reply.status == 200
        for received in prefill.received + decode.received:
            assert received.header("authorization") is None


async def test_a_backend_with_api_key_refuses_the_proxy_without_one():
    async with keyed_setup() as (proxy, prefill, decode):
        reply = await proxy.request("GET", "/v1/models")
        assert reply.status == 401  # vLLM's answer, relayed: the key is what makes it work


async def test_bootstrap_server_never_gets_the_backend_key():
    prefill, decode = await start_pair(api_key=BACKEND_KEY)

    async def engine_map(req: Any, responder: Any) -> None:
        await responder.send_json(200, {rank: {"engine_id": engine_id}
                                        for rank, engine_id in prefill.engine_ids.items()})

    bootstrap = await ScriptedBackend(engine_map).start()
    url = f"{prefill.url}#bootstrap_port={bootstrap.port}"
    try:
        async with running_proxy(config_for(url, decode.url, kv_protocol="mooncake",
                                            backend_api_key=BACKEND_KEY)) as proxy:
            await proxy.request("POST", "/v1/chat/completions", chat())
            assert [r.path for r in bootstrap.received] == ["/query"]
            assert bootstrap.received[0].header("authorization") is None
            assert prefill.received[0].header("authorization") == (
                f"Bearer {BACKEND_KEY}".encode())
    finally:
        await bootstrap.close()
        await prefill.close()
        await decode.close()


async def test_backend_key_file_rotation_is_used_from_the_next_request(tmp_path):
    path = str(tmp_path / "backend-key")
    _rewrite(path, "first-backend-key\n")
    async with keyed_setup(backend_key="first-backend-key",
                           backend_api_key_file=path) as (proxy, prefill, decode):
        assert (await proxy.request("GET", "/v1/models")).status == 200
        decode.api_key = prefill.api_key = "second-backend-key-longer"
        assert (await proxy.request("GET", "/v1/models")).status == 401
        _rewrite(path, "second-backend-key-longer\n")
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
        assert decode.received[-1].header("authorization") == b"Bearer second-backend-key-longer"


# -- forwarding the client's authorization


async def test_forward_authorization_sends_the_clients_header_to_both_legs():
    async with keyed_setup(backend_key="client-own-key", forward_authorization=True) as (
            proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=bearer("client-own-key"))
        assert reply.status == 200
        assert prefill.received[0].header("authorization") == b"Bearer client-own-key"
        assert decode.received[0].header("authorization") == b"Bearer client-own-key"
        assert (await proxy.request("GET", "/v1/models")).status == 401  # none to forward


# -- client keys


async def test_client_keys_are_required_except_for_probes_and_the_admin_path():
    async with keyed_setup(backend_key=None, client_api_keys=(CLIENT_KEY, OTHER_CLIENT_KEY),
                           admin_api_key="adm") as (proxy, prefill, decode):
        for headers in ([], bearer("wrong"), bearer(CLIENT_KEY + "x"),
                        [("authorization", CLIENT_KEY)], [("x-api-key", CLIENT_KEY)]):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                 ("POST", "/v1/embeddings")):
                reply = await proxy.request(method, path, chat() if method == "POST" else None,
                                            headers=headers)
                assert reply.status == 401
                error = reply.json()["error"]
                assert error["type"] == "invalid_api_key" and error["code"] == 401
                assert isinstance(error["message"], str)
                assert reply.header("www-authenticate") == b"Bearer"
        assert prefill.received == [] and decode.received == []
        for path in ("/health", "/healthz", "/readyz", "/metrics"):
            assert (await proxy.request("GET", path)).status == 200, path
        reply = await proxy.request("POST", "/instances/add", headers=[("x-admin-api-key",
                                                                        "adm")])
        assert reply.status == 200 and reply.json() == {"status": "ok"}
        for key in (CLIENT_KEY, OTHER_CLIENT_KEY):
            reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                        headers=bearer(key))
            assert reply.status == 200
        # The client's key is the proxy's business: it does not reach a backend.
        for received in prefill.received + decode.received:
            assert received.header("authorization") is None


async def test_client_key_file_changes_are_used_from_the_next_request(tmp_path):
    path = str(tmp_path / "client-keys")
    _rewrite(path, "old-client-key\n")
    async with keyed_setup(backend_key=None, client_api_keys_file=path) as (proxy, _, decode):
        assert (await proxy.request("GET", "/v1/models", headers=bearer("old-client-key"))
                ).status == 200
        _rewrite(path, "new-client-key-1\nnew-client-key-2\n")
        assert (await proxy.request("GET", "/v1/models", headers=bearer("old-client-key"))
                ).status == 401
        assert (await proxy.request("GET", "/v1/models", headers=bearer("new-client-key-2"))
                ).status == 200
        assert len(decode.received) == 2


async def test_client_keys_with_forwarding_forward_the_clients_header():
    async with keyed_setup(backend_key=CLIENT_KEY, client_api_keys=(CLIENT_KEY,),
                           forward_authorization=True) as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=bearer(CLIENT_KEY))
        assert reply.status == 200
        assert decode.received[0].header("authorization") == f"Bearer {CLIENT_KEY}".encode()


async def test_metrics_passed_to_decode_need_no_client_key():
    """With a metrics port, the main port's /metrics goes to decode; it needs no key,
    as lowproxy's own /metrics does not (llm-d's scheduler scrapes it keyless)."""
    async with keyed_setup(client_api_keys=(CLIENT_KEY,), metrics_port=free_port()) as (
            proxy, prefill, decode):
        reply = await proxy.request("GET", "/metrics")
        assert reply.status == 200 and b"vllm:" in reply.body
        assert decode.received[-1].path == "/metrics"
        assert (await proxy.request("GET", "/v1/models")).status == 401  # the rest do


async def test_forwarding_sends_only_the_authorization_that_was_checked():
    """A second authorization header (one lowproxy never checked) does not reach the
    backends, nor one the client's Connection names as hop-by-hop."""
    async with keyed_setup(backend_key=CLIENT_KEY, client_api_keys=(CLIENT_KEY,),
                           forward_authorization=True) as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=bearer(CLIENT_KEY) + [
                                        ("authorization", "Bearer attacker-chosen")])
        assert reply.status == 200
        seen = [value for name, value in decode.received[0].headers if name == b"authorization"]
        assert seen == [f"Bearer {CLIENT_KEY}".encode()]
        received = len(decode.received)
        reply = await proxy.request("GET", "/v1/models", headers=bearer(CLIENT_KEY) + [
            ("connection", "authorization")])
        assert len(decode.received) == received + 1  # checked here, then not forwarded:
        assert decode.received[-1].header("authorization") is None
        assert reply.status == 401  # the backend's own refusal


# -- no key anywhere it could leak


async def test_no_key_in_logs_metrics_or_error_bodies(tmp_path, caplog):
    key_file = str(tmp_path / "client-keys")
    _rewrite(key_file, f"{OTHER_CLIENT_KEY}\n")
    secrets = (BACKEND_KEY, OTHER_CLIENT_KEY, "adm-key-secret", "wrong-presented-key")
    caplog.set_level(logging.DEBUG)
    bodies = []
    async with keyed_setup(backend_key=BACKEND_KEY, backend_api_key=BACKEND_KEY,
                           client_api_keys_file=key_file, admin_api_key="adm-key-secret") as (
            proxy, prefill, decode):
        for headers in (bearer("wrong-presented-key"), bearer(OTHER_CLIENT_KEY)):
            reply = await proxy.request("POST", "/v1/chat/completions", chat(), headers=headers)
            bodies.append(reply.body)
        await prefill.close()  # a failing prefill leg: its warnings name backends, not keys
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=bearer(OTHER_CLIENT_KEY))
        bodies.append(reply.body)
        for body in ({"type": "decode", "instance": "127.0.0.1:1"}, {"type": "x"}):
            reply = await proxy.request("POST", "/instances/add", body,
                                        headers=[("x-admin-api-key", "adm-key-secret")])
            bodies.append(reply.body)
        bodies.append((await proxy.request("POST", "/instances/add",
                                           headers=bearer("wrong-presented-key"))).body)
        os.remove(key_file)  # a failing key file: its warning names the file only
        bodies.append((await proxy.request("GET", "/v1/models",
                                           headers=bearer(OTHER_CLIENT_KEY))).body)
        bodies.append((await proxy.request("GET", "/instances",
                                           headers=[("x-admin-api-key", "adm-key-secret")])).body)
        metrics = (await proxy.request("GET", "/metrics")).body.decode()
    assert any("unusable" in record.getMessage() for record in caplog.records)
    assert any("not added" in record.getMessage() for record in caplog.records)
    for secret in secrets:
        assert secret not in caplog.text and secret not in metrics
        for body in bodies:
            assert secret.encode() not in body


def test_no_key_in_the_daemons_output(tmp_path):
    key_file = tmp_path / "backend-key"
    key_file.write_text(BACKEND_KEY + "\n")
    daemon = Daemon(["--log-level", "debug", "--decode", "http://127.0.0.1:1"],
                    {"PD_PROXY_BACKEND_API_KEY_FILE": str(key_file),
                     "PD_PROXY_CLIENT_API_KEYS": CLIENT_KEY, "ADMIN_API_KEY": "adm-key-secret",
                     "PD_PROXY_PORT": "0", "PD_PROXY_HOST": "127.0.0.1"})
    try:
        port = daemon.wait_listening()

        async def traffic() -> list[bytes]:
            bodies = []
            for headers in (bearer(CLIENT_KEY), bearer("wrong-presented-key")):
                bodies.append((await request(port, "POST", "/v1/chat/completions", chat(),
                                             headers=headers)).body)
            bodies.append((await request(port, "GET", "/metrics")).body)
            bodies.append((await request(port, "POST", "/instances/add",
                                         {"type": "prefill", "instance": "127.0.0.1:1"},
                                         headers=[("x-admin-api-key", "adm-key-secret")])).body)
            return bodies

        bodies = asyncio.run(traffic())
    finally:
        assert daemon.stop() == 0
    out = daemon.output()
    assert "no decode backend" in out  # the failure was logged, naming no key
    for secret in (BACKEND_KEY, CLIENT_KEY, "adm-key-secret", "wrong-presented-key"):
        assert secret not in out
        for body in bodies:
            assert secret.encode() not in body
