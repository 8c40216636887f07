"""HTTPS on the main port: served, mTLS enforced, a renewed certificate picked up live.

The daemon serves a trustme certificate for "localhost"; clients verify it
against the trustme CA with hostname checks on. The metrics port stays plain.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import time

import h11
import pytest
import trustme

from helpers import Client, Daemon, free_port, request
from lowproxy.demo import start_pair


def client_context(ca: trustme.CA, client: trustme.LeafCert | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if client is not None:
        client.configure_cert(context)
    return context


async def https_get(port: int, context: ssl.SSLContext, target: str = "/v1/models"
                    ) -> tuple[int, bytes, ssl.SSLObject]:
    """One GET over TLS; the status, the body and the TLS object (to see the peer's cert)."""
    client = await Client.open(port, ssl=context, server_hostname="localhost")
    try:
        client.send("GET", target, headers=[("connection", "close")], host="localhost")
        reply = await client.reply()
        return reply.status, reply.body, client.writer.get_extra_info("ssl_object")
    finally:
        client.close()
        try:
            await client.writer.wait_closed()
        except (ConnectionError, ssl.SSLError):
            pass


def write_pair(tmp_path, cert: trustme.LeafCert) -> tuple[str, str]:
    """Certificate and key, each replaced in one rename (as a Secret update does)."""
    cert_file, key_file = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    for blob, path in ((cert.cert_chain_pems[0], cert_file), (cert.private_key_pem, key_file)):
        blob.write_to_path(path + ".new")
        os.replace(path + ".new", path)
    return cert_file, key_file


def wait_for_line(daemon: Daemon, text: str, timeout: float = 15.0) -> None:
    """Read the daemon's stderr until a line contains ``text`` (it polls once a second)."""
    assert daemon.proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = daemon.proc.stderr.readline().decode(errors="replace")
        daemon.lines.append(line)
        if text in line:
            return
        if not line and daemon.proc.poll() is not None:
            break
    raise AssertionError(f"no line with {text!r}: {daemon.lines}")


@pytest.fixture
async def backends():
    prefill, decode = await start_pair()
    yield prefill, decode
    await prefill.close()
    await decode.close()


def tls_daemon(backends, cert_file: str, key_file: str, **extra: str) -> Daemon:
    prefill, decode = backends
    env = {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0", "PD_PROXY_LOOP": "asyncio",
           "PD_PROXY_DECODE_URL": decode.url, "PD_PROXY_TLS_CERT_FILE": cert_file,
           "PD_PROXY_TLS_KEY_FILE": key_file, **extra}
    return Daemon([], env)


async def stopped(daemon: Daemon) -> None:
    assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0, daemon.output()


async def test_https_is_served_with_tls12_or_newer_and_alpn_http11(tmp_path, backends):
    ca = trustme.CA()
    cert_file, key_file = write_pair(tmp_path, ca.issue_cert("localhost"))
    metrics_port = free_port()
    daemon = tls_daemon(backends, cert_file, key_file,
                        PD_PROXY_METRICS_PORT=str(metrics_port))
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        context = client_context(ca)
        context.set_alpn_protocols(["h2", "http/1.1"])
        status, body, tls = await https_get(port, context)
        assert status == 200 and b"data" in body
        assert tls.selected_alpn_protocol() == "http/1.1"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        twelve = client_context(ca)
        twelve.maximum_version = ssl.TLSVersion.TLSv1_2
        status, _, tls = await https_get(port, twelve)
        assert status == 200 and tls.version() == "TLSv1.2"
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await https_get(port, client_context(trustme.CA()))  # not our CA: refused
        # Plain HTTP on the TLS port gets no answer; the metrics port stays plain.
        with pytest.raises((h11.ProtocolError, ConnectionError)):
            await request(port, "GET", "/healthz")
        assert (await request(metrics_port, "GET", "/readyz")).status == 200
    finally:
        await stopped(daemon)


async def test_client_certificates_are_required_with_a_client_ca(tmp_path, backends):
    server_ca, client_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    cert_file, key_file = write_pair(tmp_path, server_ca.issue_cert("localhost"))
    client_ca_file = str(tmp_path / "clients.pem")
    client_ca.cert_pem.write_to_path(client_ca_file)
    daemon = tls_daemon(backends, cert_file, key_file,
                        PD_PROXY_TLS_CLIENT_CA_FILE=client_ca_file)
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        status, _, _ = await https_get(port, client_context(server_ca,
                                                            client_ca.issue_cert("client")))
        assert status == 200
        for client in (None, stranger_ca.issue_cert("client")):
            # TLS 1.3: the refusal of the client's certificate arrives after the
            # client's handshake has finished, as an alert on the first read.
            with pytest.raises((ssl.SSLError, ConnectionError, h11.RemoteProtocolError)):
                await https_get(port, client_context(server_ca, client))
    finally:
        await stopped(daemon)


async def test_a_renewed_certificate_is_used_without_a_restart(tmp_path, backends):
    first_ca, second_ca = trustme.CA(), trustme.CA()
    cert_file, key_file = write_pair(tmp_path, first_ca.issue_cert("localhost"))
    daemon = tls_daemon(backends, cert_file, key_file)
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        assert (await https_get(port, client_context(first_ca)))[0] == 200
        # A half-written rotation (a key that does not match) keeps the old pair.
        second = second_ca.issue_cert("localhost")
        second.cert_chain_pems[0].write_to_path(cert_file + ".new")
        os.replace(cert_file + ".new", cert_file)
        await asyncio.to_thread(wait_for_line, daemon, "keeping the previous ones")
        assert (await https_get(port, client_context(first_ca)))[0] == 200
        write_pair(tmp_path, second)
        await asyncio.to_thread(wait_for_line, daemon, "TLS certificate reloaded")
        assert (await https_get(port, client_context(second_ca)))[0] == 200
        with pytest.raises(ssl.SSLError):
            await https_get(port, client_context(first_ca))
    finally:
        await stopped(daemon)
