"""Property: whatever bytes a client sends, the proxy answers no 5xx and keeps serving.

The proxy runs as a daemon (``python -m lowproxy --demo``: embedded demo
backends, so a request that happens to be valid is really proxied). Each
example is sent on a fresh connection and half-closed; every status line the
proxy sends back must be below 500 (505 for an unknown HTTP version is the one
5xx a client may earn), and the proxy must answer a health check afterwards.
"""

from __future__ import annotations

import re
import socket

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import Daemon, follow_output

STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


@pytest.fixture(scope="module")
def daemon():
    proc = Daemon(["--demo", "--host", "127.0.0.1", "--port", "0"],
                  {"PD_PROXY_HEADER_TIMEOUT_SECONDS": "2", "PD_PROXY_MAX_BODY_BYTES": "65536",
                   "PD_PROXY_MAX_HEADER_BYTES": "8192", "PD_PROXY_LOOP": "asyncio"})
    proc.wait_listening()
    reader = follow_output(proc)
    yield proc
    assert proc.stop() == 0
    reader.join(5)
    assert "Traceback" not in proc.output(), proc.output()


def send(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data``; half-close once the proxy has nothing more to say; read to the end.

    The half-close comes only after a short silence, so a complete request is
    answered before the proxy sees the end of input (an end of input while a
    request is handled means the client left, and it gets no answer).
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the proxy refused early and closed: read what it said
            pass
        chunks = []
        half_closed = False
        while True:
            sock.settimeout(timeout if half_closed else 0.05)
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                if half_closed:
                    raise
                half_closed = True
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def healthy(port: int) -> bool:
    raw = send(port, b"GET /health HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n")
    return raw.startswith(b"HTTP/1.1 200 ")


# -- requests that look like HTTP, so the fuzzer gets past the request line

METHODS = st.sampled_from([b"GET", b"POST", b"HEAD", b"OPTIONS", b"PUT", b"get", b"", b"G T",
                           b"POST\x00", b"CONNECT"])
TARGETS = st.sampled_from([b"/v1/chat/completions", b"/v1/completions", b"/v1/models",
                           b"/health", b"/readyz", b"/metrics", b"/v1/instances/add", b"*",
                           b"http://evil:1/v1/models", b"/%00", b"/v1/../x", b"", b"/a b",
                           b"/\xff"])
VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.9", b"HTTP/1",
                            b"http/1.1", b"HTTP/1.1 ", b""])
NAMES = st.sampled_from([b"host", b"content-length", b"transfer-encoding", b"connection",
                         b"expect", b"x-prefiller-host-port", b"x-request-id", b"content-type",
                         b"authorization", b"upgrade", b"te", b"Host ", b" host", b"", b"x:y"])
VALUES = st.one_of(
    st.sampled_from([b"chunked", b"0", b"5", b"-1", b"1, 1", b"99999999999999999999",
                     b"100-continue", b"close", b"keep-alive", b"127.0.0.1:1", b"gzip",
                     b"application/json", b"x", b"", b" chunked", b"\x00", b"\xff\xfe"]),
    st.binary(max_size=40))
EOLS = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\n "])
BODIES = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b'{"model":"m","prompt":"x","max_tokens":2}',
                     b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}',
                     b"0\r\n\r\n", b"5\r\nabcde\r\n0\r\n\r\n", b"zz\r\n",
                     b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n", b"[1,2]", b"{", b"null"]))


def mostly(usual: bytes, others: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """``usual`` three times in four: enough valid HTTP to get past the parser."""
    return st.one_of(st.just(usual), st.just(usual), st.just(usual), others)


@st.composite
def http_like(draw) -> bytes:
    eol = draw(mostly(b"\r\n", EOLS))
    method = draw(mostly(b"POST", METHODS))
    target = draw(mostly(b"/v1/completions", TARGETS))
    line = method + b" " + target + b" " + draw(mostly(b"HTTP/1.1", VERSIONS))
    headers = [draw(mostly(b"x-fuzz", NAMES)) + b": " + draw(mostly(b"1", VALUES))
               for _ in range(draw(st.integers(min_value=0, max_value=3)))]
    if draw(st.integers(0, 9)):
        headers.insert(0, b"Host: x")
    body = draw(BODIES)
    if draw(st.booleans()):  # framed as the client means it, most of the time
        headers.append(b"content-length: %d" % len(body))
    head = eol.join([line, *headers]) + eol + eol
    return head + body + draw(st.binary(max_size=20) | st.just(b""))


REQUESTS = st.one_of(st.binary(min_size=1, max_size=2048), http_like(),
                     st.lists(http_like(), min_size=2, max_size=3).map(b"".join))


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=REQUESTS)
def test_random_bytes_never_earn_a_5xx_nor_stop_the_proxy(daemon, data):
    raw = send(daemon.port, data)
    statuses = [int(code) for code in STATUS_LINE.findall(raw)]
    # What the examples reached, for --hypothesis-show-statistics.
    event(f"answered {sorted(set(statuses)) or 'nothing'}"
          + (" (parser)" if b'"type":"bad_request"' in raw else ""))
    assert all(code < 500 or code == 505 for code in statuses), (data, raw)
    assert daemon.proc.poll() is None, daemon.output()
    assert healthy(daemon.port), data


def test_the_status_scan_finds_every_response():
    """The scan the property relies on sees a 5xx behind another response."""
    raw = (b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}"
           b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
    assert [int(code) for code in STATUS_LINE.findall(raw)] == [400, 502]
