"""Upstream TLS: PD_PROXY_CA_FILE trusted exclusively, hostnames verified, rotation, fail closed.

Backends serve a trustme certificate for "localhost" on 127.0.0.1 and are
dialled as https://localhost:PORT, so hostname verification is really on.
"""

from __future__ import annotations

import logging
import os
import ssl

import pytest
import trustme

from helpers import Daemon, chat, config_for, running_proxy
from lowproxy.demo import DemoBackend, KvRegistry
from lowproxy.proxy import Proxy
from lowproxy.tls import TrustUnavailable

NO_DECODE = {"error": {"message": "no available decode backend", "type": "no_decode_backend"}}


def server_context(ca: trustme.CA, name: str = "localhost") -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    return context


def write_bundle(path: str, ca: trustme.CA) -> None:
    """Write a CA bundle and move it over ``path`` in one rename, as a rotation does."""
    staging = path + ".new"
    ca.cert_pem.write_to_path(staging)
    os.replace(staging, path)


async def tls_demo(role: str, context: ssl.SSLContext, registry: KvRegistry) -> DemoBackend:
    backend = DemoBackend(role, registry=registry)
    await backend.server.listen("127.0.0.1", 0, ssl=context)
    backend.port = backend.server.ports[0]
    return backend


def https(backend: DemoBackend, host: str = "localhost") -> str:
    return f"https://{host}:{backend.port}"


@pytest.fixture
def other_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def bundle(tmp_path, ca) -> str:
    path = str(tmp_path / "ca.pem")
    write_bundle(path, ca)
    return path


async def test_verified_https_both_legs_with_kv_relayed(ca, bundle):
    registry = KvRegistry()
    prefill = await tls_demo("prefill", server_context(ca), registry)
    decode = await tls_demo("decode", server_context(ca), registry)
    try:
        config = config_for(https(prefill), https(decode), ca_file=bundle)
        async with running_proxy(config) as proxy:
            reply = await proxy.request("POST", "/v1/chat/completions", chat(stream=True))
            assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
            [pf], [dc] = prefill.received, decode.received
            assert pf.body["kv_transfer_params"]["do_remote_decode"] is True
            assert dc.body["kv_transfer_params"]["remote_block_ids"] == [[1, 2, 3]]
            assert dc.header("host") == f"localhost:{decode.port}".encode()
            assert (await proxy.request("GET", "/v1/models")).status == 200
    finally:
        await prefill.close()
        await decode.close()


async def test_ca_file_with_surrounding_spaces_is_used(ca, bundle):
    from lowproxy.config import load_config

    decode = await tls_demo("decode", server_context(ca), KvRegistry())
    try:
        config, _ = load_config([], {"PD_PROXY_DECODE_URL": https(decode) + "/",
                                     "PD_PROXY_CA_FILE": f"  {bundle}  ",
                                     "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0"})
        async with running_proxy(config) as proxy:
            assert (await proxy.request("GET", "/v1/models")).status == 200
    finally:
        await decode.close()


async def test_hostname_is_verified(ca, bundle):
    # The certificate names "localhost"; dialled by address, verification must fail.
    decode = await tls_demo("decode", server_context(ca), KvRegistry())
    try:
        async with running_proxy(config_for((), https(decode, "127.0.0.1"),
                                            ca_file=bundle)) as proxy:
            reply = await proxy.request("POST", "/v1/chat/completions", chat())
            assert reply.status == 503 and reply.json() == NO_DECODE
        assert decode.received == []
    finally:
        await decode.close()


async def test_wrong_ca_is_refused_as_no_decode(ca, other_ca, tmp_path):
    wrong = str(tmp_path / "other.pem")
    write_bundle(wrong, other_ca)
    decode = await tls_demo("decode", server_context(ca), KvRegistry())
    try:
        config = config_for((), https(decode), ca_file=wrong, no_decode_status=502,
                            no_decode_message="decode untrusted")
        async with running_proxy(config) as proxy:
            for method, body in [("POST", chat()), ("GET", None)]:
                reply = await proxy.request(method, "/v1/chat/completions", body)
                assert reply.status == 502
                assert reply.json() == {"error": {"message": "decode untrusted",
                                                  "type": "no_decode_backend"}}
        assert decode.received == []
    finally:
        await decode.close()


async def test_prefill_with_bad_tls_is_hidden_and_decode_gets_no_kv(ca, other_ca, bundle,
                                                                   caplog):
    caplog.set_level(logging.WARNING, logger="lowproxy")
    registry = KvRegistry()
    prefill = await tls_demo("prefill", server_context(other_ca), registry)
    decode = await tls_demo("decode", server_context(ca), registry)
    try:
        async with running_proxy(config_for(https(prefill), https(decode),
                                            ca_file=bundle)) as proxy:
            reply = await proxy.request("POST", "/v1/chat/completions", chat())
            assert reply.status == 200
            assert b"certificate" not in reply.body.lower()
        assert prefill.received == []
        [dc] = decode.received
        assert "kv_transfer_params" not in dc.body
        assert any("prefill" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING)
    finally:
        await prefill.close()
        await decode.close()


# -- the CA file at start


BROKEN_PEM = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize("content", [None, b"", b"not a certificate\n", BROKEN_PEM])
def test_unusable_ca_file_stops_the_start(tmp_path, content):
    path = str(tmp_path / "ca.pem")
    if content is not None:
        with open(path, "wb") as f:
            f.write(content)
    with pytest.raises(TrustUnavailable):
        Proxy(config_for((), "https://localhost:1", ca_file=path))
    daemon = Daemon([], {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0",
                         "PD_PROXY_DECODE_URL": "https://localhost:1",
                         "PD_PROXY_CA_FILE": path})
    status = daemon.proc.wait(30)
    output = daemon.output()
    assert status != 0, output
    assert "listening on" not in output
    assert path in output


def test_ca_file_directory_stops_the_start(tmp_path):
    with pytest.raises(TrustUnavailable):
        Proxy(config_for((), "https://localhost:1", ca_file=str(tmp_path)))


# -- rotation and failing closed


async def test_rotation_by_rename_is_picked_up_without_restart(ca, other_ca, bundle):
    context = server_context(ca)
    decode = await tls_demo("decode", context, KvRegistry())
    try:
        async with running_proxy(config_for((), https(decode), ca_file=bundle)) as proxy:
            assert (await proxy.request("GET", "/v1/models")).status == 200
            # The trusted CA changes; decode still presents the old one's certificate.
            # The pooled connection made under the old trust must not be reused.
            write_bundle(bundle, other_ca)
            reply = await proxy.request("GET", "/v1/models")
            assert reply.status == 503 and reply.json() == NO_DECODE
            # Decode now presents a certificate from the new CA: trusted, no restart.
            other_ca.issue_cert("localhost").configure_cert(context)
            assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
            assert len(decode.received) == 2
    finally:
        await decode.close()


async def test_symlink_swap_rotation_is_picked_up(ca, other_ca, tmp_path):
    # Kubernetes updates a projected Secret by swapping a ..data symlink.
    for name, authority in (("v1", ca), ("v2", other_ca)):
        os.mkdir(tmp_path / name)
        authority.cert_pem.write_to_path(str(tmp_path / name / "ca.pem"))
    os.symlink("v1", tmp_path / "..data")
    os.symlink("..data/ca.pem", tmp_path / "ca.pem")
    context = server_context(other_ca)
    decode = await tls_demo("decode", context, KvRegistry())
    try:
        config = config_for((), https(decode), ca_file=str(tmp_path / "ca.pem"))
        async with running_proxy(config) as proxy:
            assert (await proxy.request("GET", "/v1/models")).status == 503
            os.symlink("v2", tmp_path / "..data_tmp")
            os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
            assert (await proxy.request("GET", "/v1/models")).status == 200
    finally:
        await decode.close()


@pytest.mark.parametrize("breakage", ["garbage", "empty", "removed"])
async def test_bundle_broken_after_start_fails_closed(ca, bundle, breakage):
    decode = await tls_demo("decode", server_context(ca), KvRegistry())
    try:
        async with running_proxy(config_for((), https(decode), ca_file=bundle)) as proxy:
            assert (await proxy.request("GET", "/v1/models")).status == 200
            if breakage == "removed":
                os.remove(bundle)
            else:
                staging = bundle + ".new"
                with open(staging, "wb") as f:
                    f.write(b"garbage\n" if breakage == "garbage" else b"")
                os.replace(staging, bundle)
            # Never the system store, never the connection pooled under the old bundle.
            for method, body in [("GET", None), ("POST", chat()), ("POST", chat(stream=True))]:
                reply = await proxy.request(method, "/v1/chat/completions", body)
                assert reply.status == 503 and reply.json() == NO_DECODE
            assert len(decode.received) == 1
            # Repaired: served again, without a restart.
            write_bundle(bundle, ca)
            assert (await proxy.request("GET", "/v1/models")).status == 200
            assert len(decode.received) == 2
    finally:
        await decode.close()
