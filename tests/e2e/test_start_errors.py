"""Mistakes at start: one line naming the problem, exit status 2, no traceback."""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import pytest

from helpers import Daemon, free_port, request

BASE = {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0", "PD_PROXY_LOOP": "asyncio"}


def refused(env: dict[str, str], args: tuple[str, ...] = ()) -> str:
    """Start lowproxy; assert it stopped with status 2 and one line; return that line."""
    daemon = Daemon(list(args), {**BASE, **env})
    status = daemon.proc.wait(30)
    output = daemon.output()
    lines = [line for line in output.splitlines() if line.strip()]
    assert status == 2, output
    assert len(lines) == 1, output
    assert "Traceback" not in output and "listening on" not in output
    return lines[0]


def test_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused({"PD_PROXY_PORT": str(port)})
    assert "address in use" in line and f"127.0.0.1:{port}" in line


def test_metrics_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused({"PD_PROXY_METRICS_PORT": str(port)})
    assert "PD_PROXY_METRICS_PORT" in line and "address in use" in line


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])
def test_a_host_that_cannot_be_bound(host):
    line = refused({"PD_PROXY_HOST": host})
    assert host in line and "cannot listen" in line


def test_metrics_port_equal_to_the_port():
    port = str(free_port())
    line = refused({"PD_PROXY_PORT": port, "PD_PROXY_METRICS_PORT": port})
    assert "PD_PROXY_METRICS_PORT" in line and port in line


@pytest.mark.parametrize("url, reason", [
    ("http://decode:8000/v1", "no path"),
    ("http://decode:8000?a=1", "no query"),
    ("http://decode:8000#weight=2", "unknown option"),
    ("http://decode:80x0", "not a port number"),
    # Names getaddrinfo cannot encode passed start and then failed every request
    # (500) and every health check (a traceback each interval).
    ("http://vllm-decode..svc:8000", "not a valid host name"),
    ("dns+http://" + "a" * 64 + ".svc:8000", "not a valid host name"),
])
def test_a_backend_url_that_would_be_misread(url, reason):
    line = refused({"PD_PROXY_DECODE_URL": url})
    assert "PD_PROXY_DECODE_URL" in line and reason in line


def test_a_listen_host_that_cannot_be_encoded():
    line = refused({"PD_PROXY_HOST": "a" * 64})
    assert "PD_PROXY_HOST" in line and "not a valid host name" in line


@pytest.mark.parametrize("which", ["missing", "garbage"])
@pytest.mark.parametrize("variable", ["PD_PROXY_CA_FILE", "PD_PROXY_TLS_CERT_FILE",
                                      "PD_PROXY_TLS_KEY_FILE", "PD_PROXY_TLS_CLIENT_CA_FILE"])
def test_a_missing_or_unusable_certificate_file(tmp_path, ca, variable, which):
    cert = ca.issue_cert("localhost")
    files = {"PD_PROXY_CA_FILE": tmp_path / "ca.pem",
             "PD_PROXY_TLS_CERT_FILE": tmp_path / "cert.pem",
             "PD_PROXY_TLS_KEY_FILE": tmp_path / "key.pem",
             "PD_PROXY_TLS_CLIENT_CA_FILE": tmp_path / "client-ca.pem"}
    ca.cert_pem.write_to_path(str(files["PD_PROXY_CA_FILE"]))
    cert.cert_chain_pems[0].write_to_path(str(files["PD_PROXY_TLS_CERT_FILE"]))
    cert.private_key_pem.write_to_path(str(files["PD_PROXY_TLS_KEY_FILE"]))
    ca.cert_pem.write_to_path(str(files["PD_PROXY_TLS_CLIENT_CA_FILE"]))
    broken = files[variable]
    if which == "missing":
        broken.unlink()
    else:
        broken.write_bytes(b"not pem at all\n")
    line = refused({name: str(path) for name, path in files.items()})
    assert str(broken) in line
    assert line.startswith(f"lowproxy: {variable}") or f"/ {variable}:" in line, line
    # Under JSON logging the one line is an object whose "setting" names it too.
    line = refused({**{name: str(path) for name, path in files.items()},
                    "PD_PROXY_LOG_FORMAT": "json"})
    named = json.loads(line)["setting"]
    assert named == variable or (variable, named) == (
        "PD_PROXY_TLS_KEY_FILE", "PD_PROXY_TLS_CERT_FILE"), line


@pytest.mark.parametrize("variable", ["PD_PROXY_CONNECT_TIMEOUT_SECONDS",
                                      "PD_PROXY_HEALTH_TIMEOUT_SECONDS",
                                      "PD_PROXY_PREFILL_TIMEOUT_SECONDS"])
def test_a_timeout_of_zero_that_would_stop_everything_is_refused(variable):
    """0 is "none" only for the decode timeouts: a 0 connect, health-check or
    prefill bound would fail every connection, check or prefill leg."""
    line = refused({variable: "0"})
    assert variable in line and "more than 0" in line


def test_a_certificate_without_its_key():
    line = refused({"PD_PROXY_TLS_CERT_FILE": "/etc/cert.pem"})
    assert "PD_PROXY_TLS_KEY_FILE" in line


async def test_an_unknown_variable_is_a_warning_naming_the_closest_setting():
    daemon = Daemon([], {**BASE, "PD_PROXY_PREFILL_URLS": "http://p:1",
                         "PD_PROXY_NOT_EVEN_CLOSE_XYZ": "1"})
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        assert (await request(port, "GET", "/healthz")).status == 200
    finally:
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0
    output = daemon.output()
    [warning] = [line for line in output.splitlines() if "PD_PROXY_PREFILL_URLS" in line]
    assert "WARNING" in warning and "did you mean PD_PROXY_PREFILL_URL?" in warning
    assert "PD_PROXY_NOT_EVEN_CLOSE_XYZ is not a lowproxy setting" in output


async def test_otel_without_an_sdk_warns_once_at_start():
    daemon = Daemon([], {**BASE, "PD_PROXY_OTEL": "1", "PD_PROXY_WORKERS": "2"})
    try:
        await asyncio.to_thread(daemon.wait_listening)
        await asyncio.to_thread(daemon.wait_listening)
    finally:
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0
    output = daemon.output()
    assert output.count("no OpenTelemetry SDK tracer provider is configured") == 1, output


def test_an_encrypted_key_is_refused_without_asking_for_its_pass_phrase(tmp_path, ca):
    """OpenSSL asks for a pass phrase on the terminal when no callback is given: at
    start an unhelpful line, at a renewal the event loop blocked on the prompt."""
    serialization = pytest.importorskip(
        "cryptography.hazmat.primitives.serialization", reason="trustme brings cryptography")
    cert = ca.issue_cert("localhost")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), None)
    key_file.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pass phrase")))
    line = refused({"PD_PROXY_TLS_CERT_FILE": str(cert_file),
                    "PD_PROXY_TLS_KEY_FILE": str(key_file)})
    assert "PD_PROXY_TLS_" in line and "encrypted" in line, line


def test_uvloop_asked_for_and_missing_is_a_start_error_before_any_worker(monkeypatch):
    """Checked before the fork: in each worker it was said once per worker, each then
    exiting, where the parent restarted them."""
    import dataclasses

    from lowproxy import daemon
    from lowproxy.config import Config

    monkeypatch.setattr(daemon, "UVLOOP_FACTORY", None)
    with pytest.raises(daemon.StartError) as caught:
        daemon.check_start(dataclasses.replace(Config(), loop="uvloop", workers=2))
    assert str(caught.value).startswith("PD_PROXY_LOOP: uvloop is not installed")
    daemon.check_start(dataclasses.replace(Config(), loop="auto"))  # auto: asyncio then
