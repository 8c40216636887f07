"""A fence around the h11 internal lowproxy's hot path relies on (lowproxy/h11_internals/).

Heads the proxy builds go to h11 with ``_parsed=True``, the flag h11's parser
passes for heads it read: the per-header regexes and ``bytesify`` are skipped,
everything else stays. Heads it receives in the plain part of h11's grammar are
read by one regex into the event h11's parser would make (receive_head,
receive_request), and a length-framed body's pieces without the state
machine's round trip (next_event): each compared with h11's own reading, on
listed heads and on random ones. Each test names what it pins; when an h11 release
changes one, the failure says which, and the upper bound on h11 in
pyproject.toml must stay below that release until lowproxy/h11_internals/ is adapted.
"""

from __future__ import annotations

import inspect

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowproxy import h11_internals
from lowproxy.keys import header_safe

HEADERS = [(b"Host", b"127.0.0.1:8100"), (b"content-type", b"application/json"),
           (b"Content-Length", b"2"), (b"x-request-id", b"abc")]


def fence(condition: object, internal: str, what: str) -> None:
    assert condition, (f"h11 {h11.__version__} changed {internal}: {what}. lowproxy's hot path "
                       "relies on it; keep the upper bound below this release until "
                       "lowproxy/h11_internals/ is adapted.")


def wire(role: type[h11.CLIENT] | type[h11.SERVER], *events: h11._events.Event) -> bytes:
    conn = h11.Connection(role)
    if role is h11.SERVER:
        conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        conn.next_event()
        conn.next_event()
    return b"".join(conn.send(event) or b"" for event in events)


@pytest.mark.parametrize("cls", [h11.Request, h11.Response, h11.InformationalResponse])
def test_the_events_still_take_parsed(cls):
    fence("_parsed" in inspect.signature(cls.__init__).parameters, f"{cls.__name__}.__init__",
          "the _parsed keyword is gone")


def test_a_request_built_parsed_writes_what_a_validated_one_writes():
    fast = h11_internals.request(b"POST", b"/v1/chat/completions", list(HEADERS))
    slow = h11.Request(method=b"POST", target=b"/v1/chat/completions", headers=list(HEADERS))
    fence(fast == slow and fast.headers.raw_items() == slow.headers.raw_items(),
          "Request(_parsed=True)", "the event differs from the validated one")
    fence(wire(h11.CLIENT, fast, h11.Data(data=b"{}"), h11.EndOfMessage())
          == wire(h11.CLIENT, slow, h11.Data(data=b"{}"), h11.EndOfMessage()),
          "Connection.send", "a parsed request writes other bytes")


def test_a_request_built_without_init_has_what_init_sets():
    import dataclasses
    fence([field.name for field in dataclasses.fields(h11.Request)]
          == ["method", "headers", "target", "http_version"], "Request's fields",
          "request() sets these four and no other")
    init = inspect.getsource(h11.Request.__init__)
    fence("normalize_and_validate(headers, _parsed=_parsed)" in init
          and all(rule in init for rule in ("host_count", "method_re", "request_target_re"))
          and "__post_init__" not in inspect.getsource(h11.Request),
          "Request.__init__", "its rules changed (request() keeps the same four)")
    for headers in ([(b"host", b"x")], [(b"host", b"x"), (b"Content-Length", b"5")],
                    [(b"host", b"x"), (b"x-a", b""), (b"X-A", b"b"), (b"content-length", b"0")]):
        fast = h11_internals.request(b"GET", b"/v1/models", list(headers))
        slow = h11.Request(method=b"GET", target=b"/v1/models", headers=list(headers))
        fence(fast == slow and fast.headers.raw_items() == slow.headers.raw_items()
              and fast.http_version == slow.http_version == b"1.1",
              "Request.__init__", f"the event differs for {headers!r}")
    # The framing checks stay: what h11 refuses, request() refuses.
    for headers in ([(b"host", b"x"), (b"content-length", b"1"), (b"content-length", b"2")],
                    [(b"host", b"x"), (b"transfer-encoding", b"gzip")]):
        with pytest.raises(h11.LocalProtocolError):
            h11_internals.request(b"POST", b"/", list(headers))


def test_responses_built_parsed_write_what_validated_ones_write():
    headers = [(b"content-type", b"text/event-stream"), (b"X-Request-Id", b"abc")]
    fast = wire(h11.SERVER, h11_internals.informational(103, [(b"link", b"</a>")], b"Early"),
                h11_internals.response(200, list(headers), b"OK"), h11.Data(data=b"hi"),
                h11.EndOfMessage())
    slow = wire(h11.SERVER, h11.InformationalResponse(status_code=103, reason=b"Early",
                                                      headers=[(b"link", b"</a>")]),
                h11.Response(status_code=200, headers=list(headers), reason=b"OK"),
                h11.Data(data=b"hi"), h11.EndOfMessage())
    fence(fast == slow and b"transfer-encoding: chunked" in fast.lower(), "Response(_parsed=True)",
          "a parsed response writes other bytes or other framing")


def test_framing_is_still_checked_when_parsed():
    with pytest.raises(h11.LocalProtocolError):
        h11_internals.response(200, [(b"content-length", b"1"), (b"content-length", b"2")],
                               b"OK")
    with pytest.raises(h11.LocalProtocolError):
        h11_internals.request(b"GET", b"/", [(b"transfer-encoding", b"gzip"), (b"host", b"x")])
    with pytest.raises(h11.LocalProtocolError):  # the Host rule and the target grammar stay
        h11_internals.request(b"GET", b"/", [])
    with pytest.raises(h11.LocalProtocolError):
        h11_internals.request(b"GET", b"/a b", [(b"host", b"x")])
    fence(True, "normalize_and_validate(_parsed=True)", "framing checks skipped")


def test_the_backend_key_check_refuses_what_h11_would():
    for value in (b"Bearer k\r\nx: y", b"Bearer k\x00", b"Bearer k ", b"Bearer k\tl\n"):
        assert not header_safe(value)
        with pytest.raises(h11.LocalProtocolError):
            h11.Request(method=b"GET", target=b"/", headers=[(b"host", b"x"),
                                                             (b"authorization", value)])
    assert not header_safe(b"Bearer k\x7f")  # stricter than h11: no control byte at all
    assert header_safe(b"Bearer sk-abc.DEF_123/+=") and header_safe("Bearer clé".encode())


def _twins(request: bytes) -> tuple[h11.Connection, h11.Connection]:
    """Two server connections that have read the same request."""
    pair = []
    for _ in range(2):
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(request)
        while type(conn.next_event()) is not h11.EndOfMessage:
            pass
        pair.append(conn)
    return pair[0], pair[1]


GET_11 = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.mark.parametrize("request_bytes, status, headers", [
    (GET_11, 200, [(b"content-type", b"application/json"), (b"content-length", b"2")]),
    (GET_11, 200, [(b"content-type", b"text/event-stream"), (b"X-Request-Id", b"abc")]),
    (GET_11, 200, [(b"transfer-encoding", b"chunked"), (b"content-length", b"5")]),
    (GET_11, 204, [(b"x-request-id", b"abc")]),
    (GET_11, 304, [(b"etag", b"\"1\"")]),
    (b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n", 200, [(b"content-type", b"text/plain")]),
    (GET_11, 200, [(b"content-length", b"2"), (b"connection", b"close")]),
    (b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", 200,
     [(b"content-length", b"2")]),
    (b"GET / HTTP/1.0\r\n\r\n", 200, [(b"content-type", b"text/plain")]),
    (b"GET / HTTP/1.0\r\n\r\n", 200, [(b"content-length", b"2")]),
])
def test_send_response_writes_and_moves_what_send_does(request_bytes, status, headers):
    fast, slow = _twins(request_bytes)
    fast_head = h11_internals.send_response(fast, h11_internals.response(status, list(headers),
                                                                         b"OK"))
    slow_head = slow.send(h11.Response(status_code=status, headers=list(headers), reason=b"OK"))
    fence(fast_head == slow_head, "Connection._clean_up_response_headers_for_sending",
          f"send_response wrote {fast_head!r}, send {slow_head!r}")
    body = [] if status in (204, 304) or request_bytes.startswith(b"HEAD") else [
        h11.Data(data=b"{}")]
    fence([fast.send(e) for e in [*body, h11.EndOfMessage()]]
          == [slow.send(e) for e in [*body, h11.EndOfMessage()]]
          and (fast.our_state, fast.their_state) == (slow.our_state, slow.their_state),
          "Connection._process_event / _writer", "the body or the states differ after the head")


def test_send_response_refuses_what_send_refuses():
    conn, _ = _twins(GET_11)
    h11_internals.send_response(conn, h11_internals.response(200, [(b"content-length", b"0")],
                                                             b"OK"))
    conn.send(h11.EndOfMessage())
    with pytest.raises(h11.LocalProtocolError):  # a second response to one request
        h11_internals.send_response(conn, h11_internals.response(200, [], b"OK"))
    fence(conn.our_state is h11.ERROR, "Connection._process_error",
          "a refused response no longer puts the connection in ERROR")
    with pytest.raises(h11.LocalProtocolError):
        h11_internals.send_response(conn, h11_internals.response(200, [], b"OK"))


@pytest.mark.parametrize("role", [h11.CLIENT, h11.SERVER])
@pytest.mark.parametrize("framing", [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")])
def test_send_data_writes_and_moves_what_send_does(role, framing):
    def opened() -> h11.Connection:
        if role is h11.CLIENT:
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method=b"POST", target=b"/", headers=[
                (b"host", b"x"), (b"expect", b"100-continue"), framing]))
            return conn
        conn, _ = _twins(GET_11)
        conn.send(h11.Response(status_code=200, headers=[framing]))
        return conn

    fast, slow = opened(), opened()
    pieces = [b"ab", b"cde"]
    fence([h11_internals.send_data(fast, p) for p in pieces]
          == [slow.send(h11.Data(data=p)) for p in pieces],
          "Connection._writer", "send_data wrote other bytes than send")
    fence((fast.our_state, fast.their_state, fast.client_is_waiting_for_100_continue)
          == (slow.our_state, slow.their_state, slow.client_is_waiting_for_100_continue),
          "Connection._process_event", "a body piece moves the states otherwise")
    fence(fast.send(h11.EndOfMessage()) == slow.send(h11.EndOfMessage()),
          "Connection._writer", "the body ends otherwise")


def test_send_data_refuses_what_send_refuses():
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=b"POST", target=b"/", headers=[(b"host", b"x"),
                                                                (b"content-length", b"2")]))
    with pytest.raises(h11.LocalProtocolError):  # more than the declared length
        h11_internals.send_data(conn, b"abc")
    fence(conn.our_state is h11.ERROR, "Connection._process_error",
          "too much data no longer puts the connection in ERROR")
    with pytest.raises(h11.LocalProtocolError):  # and nothing is sent in ERROR
        h11_internals.send_data(conn, b"a")
    idle = h11.Connection(h11.CLIENT)
    with pytest.raises(h11.LocalProtocolError):  # no request yet: no body
        h11_internals.send_data(idle, b"a")


# receive_head: a backend's response head read without h11's line splitting,
# for the heads every backend sends; everything else through h11's parser.

_VLLM_HEAD = (b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 04:52:57 GMT\r\nserver: uvicorn\r\n"
              b"content-length: 500\r\ncontent-type: application/json\r\n"
              b"endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.5\r\n\r\n")

RESPONSE_HEADS = [
    _VLLM_HEAD,
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 200 \r\ncontent-length: 3\r\n\r\n",
    b"HTTP/1.1 404 Not Found\r\n\r\n",
    b"HTTP/1.1 204 No Content\r\ncontent-length: 7\r\n\r\n",
    b"HTTP/1.1 304 Not Modified\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-empty:\r\nx-spaces: \t a \t b \t\r\ncontent-length: 1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-obs: caf\xc3\xa9 \xff\r\ncontent-length: 1\r\n\r\n",
    b"HTTP/1.1 200 R\xe9ason\twith tab\r\ncontent-length: 1\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n",
    # Refused by h11 (the same error either way) or outside the fast subset:
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.1 099 Low\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\n\r\n",
    b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n",
    b"HTTP/1.1 200 OK\ncontent-length: 1\n\n",
    b"HTTP/1.1 200 OK\r\nx-fold: a\r\n  b\r\ncontent-length: 1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-ctl: a\x01b\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-nul: a\x00b\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbad name: a\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n: no name\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno-colon\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-cr: a\rb\r\n\r\n",
    b"HTTP/1.1 20x OK\r\n\r\n",
    b"HTTP/2 200 OK\r\n\r\n",
    b"http/1.1 200 OK\r\n\r\n",
    b"\r\n\r\n",
]


def _sent(method: bytes = b"POST") -> h11.Connection:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target=b"/v1/chat/completions",
                          headers=[(b"host", b"x"), (b"content-length", b"0")]))
    conn.send(h11.EndOfMessage())
    return conn


def _outcome(conn: h11.Connection, read: object, head: bytes, body: bytes) -> tuple:
    try:
        event = read(conn, head)
    except h11.RemoteProtocolError as exc:
        return ("error", type(exc), str(exc), conn.their_state)
    seen: list[object] = [type(event)]
    if isinstance(event, (h11.Response, h11.InformationalResponse)):
        seen += [event.status_code, event.reason, event.http_version,
                 event.headers.raw_items(), list(event.headers)]
    seen += [conn.our_state, conn.their_state, conn.their_http_version,
             conn._cstate.keep_alive, type(conn._reader), vars(conn._reader or object())]
    # What follows the head reads alike too.
    conn.receive_data(body)
    try:
        for _ in range(4):
            follow = conn.next_event()
            seen.append(follow)
            if follow is h11.NEED_DATA or isinstance(follow, h11.EndOfMessage):
                break
    except h11.RemoteProtocolError as exc:
        seen.append(("error", str(exc)))
    seen += [conn.our_state, conn.their_state]
    return tuple(seen)


def _by_h11(conn: h11.Connection, head: bytes) -> object:
    conn.receive_data(head)
    return conn.next_event()


@pytest.mark.parametrize("method", [b"POST", b"HEAD"])
@pytest.mark.parametrize("head", RESPONSE_HEADS)
def test_receive_head_reads_what_h11_reads(head, method):
    for body in (b"abcde", b"3\r\nabc\r\n0\r\n\r\n"):
        fence(_outcome(_sent(method), h11_internals.receive_head, head, body)
              == _outcome(_sent(method), _by_h11, head, body),
              "Connection.next_event / _process_event",
              f"a response head ({head!r}) read without h11's parser differs from h11's read")


def test_receive_head_skips_h11s_parser_for_a_plain_head(monkeypatch):
    # The fast path is taken for what backends send (else it is dead weight).
    conn = _sent()
    monkeypatch.setattr(conn, "receive_data", lambda data: pytest.fail("h11 parsed it"))
    event = h11_internals.receive_head(conn, _VLLM_HEAD)
    assert isinstance(event, h11.Response) and event.status_code == 200
    assert conn.their_state is h11.SEND_BODY and conn._reader._remaining == 500


def _idle() -> h11.Connection:
    return h11.Connection(h11.CLIENT)


def _holding() -> h11.Connection:
    conn = _sent()
    conn.receive_data(b"HTTP/1.1 1")
    assert conn.next_event() is h11.NEED_DATA
    return conn


@pytest.mark.parametrize("make", [_idle, _holding])
def test_receive_head_leaves_other_states_to_h11(make):
    # A head before the request went out, or while h11 holds part of one, is
    # h11's to judge: receive_head hands it over, with the same outcome.
    def spy(conn: h11.Connection, head: bytes) -> object:
        conn.receive_data = lambda data, real=conn.receive_data: calls.append(data) or real(data)
        return h11_internals.receive_head(conn, head)
    calls: list[bytes] = []
    assert _outcome(make(), spy, _VLLM_HEAD, b"x") == _outcome(make(), _by_h11, _VLLM_HEAD, b"x")
    assert calls[0] == _VLLM_HEAD  # (then _outcome feeds the body)


_HEAD_BYTES = [b"HTTP/1.1 ", b"HTTP/1.0 ", b"200", b"101", b"204", b"099", b" OK", b"\r\n",
               b"\n", b"content-length: ", b"transfer-encoding: ", b"chunked", b"connection: ",
               b"close", b"5", b"x-a:", b" ", b"\t", b"\x80", b"\x01", b"\x00", b":", b"a",
               b",", b"\r"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_HEAD_BYTES), max_size=24))
def test_receive_head_agrees_with_h11_on_random_heads(pieces):
    head = b"".join(pieces)
    if not head.endswith(b"\r\n\r\n"):
        head += b"\r\n\r\n"
    assert (_outcome(_sent(), h11_internals.receive_head, head, b"abcde")
            == _outcome(_sent(), _by_h11, head, b"abcde")), head


# receive_request: a client's first read of a request (head, and the body's
# first bytes when they came with it).

_CLIENT_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
                b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
                b"Content-Type: application/json\r\nAuthorization: Bearer sk-x\r\n"
                b"Content-Length: 5\r\n\r\n")

REQUEST_READS = [
    _CLIENT_HEAD + b"abcde",
    _CLIENT_HEAD + b"ab",
    _CLIENT_HEAD,
    _CLIENT_HEAD + b"abcdeGET / HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nabcde\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
    b"content-length: 5\r\n\r\n",
    b"GET /ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
    b"CONNECT a:443 HTTP/1.1\r\nhost: a:443\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET http://x/a?b=%20 HTTP/1.1\r\nhost: x\r\nx-obs: \xc3\xa9\r\nx-e:\r\n\r\n",
    # Refused by h11, or outside the fast subset:
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
    b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
    b"GET / HTTP/1.0\r\n\r\n",
    b"GET / HTTP/1.1\nhost: x\n\n",
    b"GET / HTTP/1.1\r\nhost: x\nx: y\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nx-fold: a\r\n b\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nx: a\x7fb\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost : x\r\n\r\n",
    b"GET /\x80 HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET  / HTTP/1.1\r\nhost: x\r\n\r\n",
    b"\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    b"GET / HTTP/1.1\r\nhost: x\r\n",
    b"",
]


def _server() -> h11.Connection:
    return h11.Connection(h11.SERVER)


def _request_outcome(conn: h11.Connection, read: object, data: bytes) -> tuple:
    try:
        event = read(conn, data)
    except h11.RemoteProtocolError as exc:
        return ("error", str(exc), exc.error_status_hint, conn.their_state)
    seen: list[object] = [event]
    if isinstance(event, h11.Request):
        seen.append(event.headers.raw_items())
    seen += [conn.our_state, conn.their_state, conn.their_http_version,
             conn._cstate.keep_alive, conn.client_is_waiting_for_100_continue,
             conn.trailing_data, type(conn._reader), vars(conn._reader or object())]
    try:
        for _ in range(4):
            follow = conn.next_event()
            seen.append(follow)
            if follow in (h11.NEED_DATA, h11.PAUSED) or isinstance(follow, h11.EndOfMessage):
                break
    except h11.RemoteProtocolError as exc:
        seen.append(("error", str(exc)))
    seen += [conn.our_state, conn.their_state, conn.trailing_data]
    return tuple(seen)


def _request_by_h11(conn: h11.Connection, data: bytes) -> object:
    conn.receive_data(data)
    return conn.next_event()


@pytest.mark.parametrize("data", REQUEST_READS)
def test_receive_request_reads_what_h11_reads(data):
    fence(_request_outcome(_server(), h11_internals.receive_request, data)
          == _request_outcome(_server(), _request_by_h11, data),
          "Connection.next_event / _process_event",
          f"a request ({data!r}) read without h11's parser differs from h11's read")


def test_receive_request_skips_h11s_parser_for_a_plain_head(monkeypatch):
    conn = _server()
    fed: list[bytes] = []
    real = conn.receive_data
    monkeypatch.setattr(conn, "receive_data", lambda data: fed.append(data) or real(data))
    event = h11_internals.receive_request(conn, _CLIENT_HEAD + b"abcde")
    assert isinstance(event, h11.Request) and event.target == b"/v1/chat/completions"
    assert fed == [b"abcde"]  # h11 was handed the body only
    assert conn.next_event() == h11.Data(data=b"abcde")


def test_receive_request_leaves_a_second_cycle_to_h11():
    # Bytes h11 already holds (a pipelined request) are parsed by h11 itself.
    conn = _server()
    first = _CLIENT_HEAD + b"abcde"
    h11_internals.receive_request(conn, first + b"GET /v1/models HTTP/1.1\r\nho")
    assert conn.next_event() == h11.Data(data=b"abcde")
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    conn.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
    conn.send(h11.EndOfMessage())
    conn.start_next_cycle()
    assert conn.next_event() is h11.NEED_DATA
    event = h11_internals.receive_request(conn, b"st: x\r\n\r\n")
    assert isinstance(event, h11.Request) and event.target == b"/v1/models"


_REQUEST_BYTES = [b"GET ", b"POST ", b"/", b"a", b" HTTP/1.1", b" HTTP/1.0", b"\r\n", b"\n",
                  b"host: x", b"Host:", b"content-length: ", b"5", b"transfer-encoding: ",
                  b"chunked", b"expect: 100-continue", b"connection: close", b" ", b"\t",
                  b"\x80", b"\x01", b":", b",", b"abcde"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_REQUEST_BYTES), max_size=24))
def test_receive_request_agrees_with_h11_on_random_reads(pieces):
    data = b"".join(pieces)
    assert (_request_outcome(_server(), h11_internals.receive_request, data)
            == _request_outcome(_server(), _request_by_h11, data)), data


# next_event: a Content-Length body's pieces and end without the state
# machine's round trip for what changes no state.

def _body_trace(role: type[h11.CLIENT] | type[h11.SERVER], read: object, head: bytes,
                pieces: list[bytes], close: bool) -> list[object]:
    conn = h11.Connection(role)
    if role is h11.CLIENT:
        conn.send(h11.Request(method=b"GET", target=b"/", headers=[(b"host", b"x")]))
        conn.send(h11.EndOfMessage())
    seen: list[object] = []

    def drain() -> None:
        for _ in range(8):
            try:
                event = read(conn)
            except h11.RemoteProtocolError as exc:
                seen.append(("error", str(exc)))
                return
            seen.append((event, conn.our_state, conn.their_state,
                         conn.client_is_waiting_for_100_continue, conn.trailing_data))
            if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
                return

    conn.receive_data(head)
    drain()
    for piece in pieces:
        conn.receive_data(piece)
        drain()
    if close:
        conn.receive_data(b"")
        drain()
    return seen


_BODY_HEADS = {
    h11.SERVER: [b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n",
                 b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n",
                 b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
                 b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"],
    h11.CLIENT: [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
                 b"HTTP/1.1 204 No Content\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"],
}


@pytest.mark.parametrize("role", [h11.SERVER, h11.CLIENT])
@pytest.mark.parametrize("pieces", [[b"abcde"], [b"ab", b"cde"], [b"abcdeGET / HTTP/1.1\r\n"],
                                    [b"ab"], [], [b"5\r\nabcde\r\n0\r\n\r\n"]])
@pytest.mark.parametrize("close", [False, True])
def test_next_event_reads_a_body_as_h11_does(role, pieces, close):
    for head in _BODY_HEADS[role]:
        fast = _body_trace(role, h11_internals.next_event, head, pieces, close)
        slow = _body_trace(role, h11.Connection.next_event, head, pieces, close)
        fence(fast == slow, "ContentLengthReader / Connection.next_event",
              f"a body read without the state machine's round trip differs ({head!r}, "
              f"{pieces!r}, close={close})")


def test_next_event_takes_the_short_way_for_a_length_framed_body(monkeypatch):
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nabcde")
    assert isinstance(conn.next_event(), h11.Request)
    monkeypatch.setattr(conn, "next_event", lambda: pytest.fail("went the long way"))
    assert h11_internals.next_event(conn) == h11.Data(data=b"abcde")
    assert h11_internals.next_event(conn) is h11_internals.END_OF_MESSAGE
    assert conn.their_state is h11.DONE


def test_one_end_of_message_serves_every_message():
    # h11 keeps no event it sends or hands out, so one instance serves all.
    conn = h11.Connection(h11.CLIENT)
    for _ in range(2):
        conn.send(h11.Request(method=b"GET", target=b"/", headers=[(b"host", b"x")]))
        assert conn.send(h11_internals.END_OF_MESSAGE) == b""
        conn.receive_data(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        conn.next_event()
        assert conn.next_event() == h11_internals.END_OF_MESSAGE
        conn.start_next_cycle()
    fence(h11_internals.END_OF_MESSAGE == h11.EndOfMessage()
          and not h11_internals.END_OF_MESSAGE.headers, "EndOfMessage", "it changed")


@pytest.mark.parametrize("role, data", [
    (h11.SERVER, b"POST / HTTP/1.1\r\nHost: x\r\nAuthorization Bearer SECRET-1\r\n\r\n"),
    (h11.CLIENT, b"HTTP/1.1 200 OK\r\nX-Seen Bearer SECRET-1\r\n\r\n"),
    (h11.CLIENT, b"HTTP/1.1 2OO SECRET-1\r\n\r\n"),
    (h11.SERVER, b"POST / HTTP/1.1\r\nHost: x\r\nx-a: SECRET-1\x00\r\n\r\n"),
])
def test_h11s_complaints_lose_the_bytes_they_quote(role, data):
    """h11 quotes the peer's offending line in its message (bytearray(b'...')):
    without_quoted_bytes keeps h11's words and drops the peer's bytes, which may
    hold a key. Should h11 quote them otherwise, this fails."""
    connection = h11.Connection(role)
    if role is h11.CLIENT:
        connection.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        connection.send(h11.EndOfMessage())
    connection.receive_data(data)
    with pytest.raises(h11.RemoteProtocolError) as caught:
        connection.next_event()
    assert "SECRET" in str(caught.value)  # h11 still quotes the bytes
    kept = h11_internals.without_quoted_bytes(str(caught.value), "fallback")
    assert "SECRET" not in kept and kept.startswith(("illegal", "Illegal", "malformed"))
