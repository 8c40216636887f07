"""The state machine's common moves (h11_internals._process) against h11's own.

lowproxy moves h11's state machine itself for the events of a plain keep-alive
exchange (a Request or Response head, EndOfMessage, the next cycle) and leaves
everything else to ``Connection._process_event``. Each test runs the same
exchange on twin connections, one through lowproxy's functions and one through
h11's public API, and compares after every step what h11 keeps: both sides'
states, keep-alive, the switch proposals, the request method, the peer's HTTP
version, 100-continue, the reader and writer (type and fields), the bytes
buffered and written, and any refusal. An h11 release that moves differently
fails here, naming the step.
"""

from __future__ import annotations

from typing import Any, Callable

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowproxy import h11_internals
from lowproxy.h11_internals.events import _normalized


def _io(obj: Any) -> Any:
    if obj is None or not hasattr(obj, "__dict__"):
        return obj  # a function (write_request, expect_nothing...) or nothing
    return type(obj), dict(vars(obj))


def snapshot(conn: h11.Connection) -> tuple:
    cstate = conn._cstate
    return (dict(cstate.states), cstate.keep_alive, set(cstate.pending_switch_proposals),
            conn._request_method, conn.their_http_version,
            conn.client_is_waiting_for_100_continue, _io(conn._reader), _io(conn._writer),
            bytes(conn._receive_buffer))


def outcome(step: Callable[[], Any]) -> tuple:
    try:
        return ("ok", step())
    except Exception as exc:  # h11's refusals, its asserts, and its own slips (a switched
        # connection's second request raises AttributeError in h11 0.16): compared alike
        return ("refused", type(exc), str(exc))


class Twins:
    """One connection moved by lowproxy's functions, one by h11's; compared after each step."""

    def __init__(self, role: type[h11.CLIENT] | type[h11.SERVER]) -> None:
        self.ours = h11.Connection(role)
        self.theirs = h11.Connection(role)
        self.steps: list[str] = []

    def step(self, name: str, ours: Callable[[h11.Connection], Any],
             theirs: Callable[[h11.Connection], Any]) -> bool:
        """Both moves; True when neither refused (the exchange can go on)."""
        self.steps.append(name)
        got, want = outcome(lambda: ours(self.ours)), outcome(lambda: theirs(self.theirs))
        assert _comparable(got) == _comparable(want), (self.steps, got, want)
        assert snapshot(self.ours) == snapshot(self.theirs), (self.steps, snapshot(self.ours),
                                                              snapshot(self.theirs))
        return got[0] == "ok"

    def send_body(self) -> bool:
        """A body of the declared length (or any, if none is declared), when one is due."""
        if self.ours.our_state is not h11.SEND_BODY:
            return True
        body = _body_for(self.ours)
        return self.step("data", lambda c: h11_internals.send_data(c, body),
                         lambda c: c.send(h11.Data(data=body)))

    def read_body(self) -> bool:
        for index in range(3):
            if self.ours.their_state is not h11.SEND_BODY:
                break
            if not self.step(f"body {index}", h11_internals.next_event,
                             lambda c: c.next_event()):
                return False
        return True

    def end(self) -> bool:
        return self.step("end", h11_internals.send_end, lambda c: c.send(h11.EndOfMessage()))

    def next_cycle(self) -> bool:
        return self.step("next cycle", h11_internals.start_next_cycle,
                         lambda c: c.start_next_cycle())


def _comparable(result: tuple) -> tuple:
    if result[0] != "ok":
        return result
    value = result[1]
    if isinstance(value, (h11.Request, h11.Response, h11.InformationalResponse)):
        fields = [type(value), value.headers.raw_items(), list(value.headers), value.http_version]
        fields += ([value.method, value.target] if isinstance(value, h11.Request)
                   else [value.status_code, value.reason])
        return ("ok", *fields)
    if isinstance(value, h11.Data):
        return ("ok", h11.Data, bytes(value.data))
    return result


# What a head may carry that h11 acts on, and what it does not.
OPTIONAL_HEADERS = [
    (b"Content-Length", b"5"), (b"content-length", b"0"), (b"transfer-encoding", b"chunked"),
    (b"Connection", b"close"), (b"connection", b"keep-alive"), (b"Connection", b"Keep-Alive, x"),
    (b"connection", b"upgrade"), (b"upgrade", b"websocket"), (b"expect", b"100-continue"),
    (b"Expect", b"x"), (b"x-request-id", b"abc"), (b"content-length", b"5, 5"),
    (b"Transfer-Encoding", b"Chunked"), (b"content-length", b"00000000000000000000005"),
    (b"Connection", b"Close"), (b"connection", b"te,  CLOSE"),
]
headers_strategy = st.lists(st.sampled_from(OPTIONAL_HEADERS), max_size=4)


def _body_for(conn: h11.Connection) -> bytes:
    writer = conn._writer
    if type(writer).__name__ == "ContentLengthWriter":
        return b"x" * writer._length
    return b"abcde"


def _client_exchange(twins: Twins, method: bytes, request_headers: list, status: int,
                     response_headers: list, send_body: bool, early: bool = False) -> bool:
    target = b"a:443" if method == b"CONNECT" else b"/v1/chat/completions"
    head = [(b"Host", b"127.0.0.1:8100"), *request_headers]
    if not twins.step("request", lambda c: h11_internals.send_request(c, method, target, head),
                      lambda c: c.send(h11.Request(method=method, target=target, headers=head))):
        return False
    if send_body and not twins.send_body():
        return False
    lines = b"".join(b"%s: %s\r\n" % pair for pair in response_headers)
    answer = b"HTTP/1.1 %d OK\r\n%s\r\n" % (status, lines)
    if early:  # the backend answers whole and hangs up before the request's end is sent
        for conn in (twins.ours, twins.theirs):
            conn.receive_data(answer + b"abcde")
            conn.receive_data(b"")
        for index in range(5):
            if not twins.step(f"early {index}", h11_internals.next_event,
                              lambda c: c.next_event()):
                return False
        return twins.end()
    if not twins.end():
        return False

    def theirs_head(conn: h11.Connection) -> Any:
        conn.receive_data(answer)
        return conn.next_event()
    if not twins.step("response", lambda c: h11_internals.receive_head(c, answer), theirs_head):
        return False
    twins.ours.receive_data(b"abcde")
    twins.theirs.receive_data(b"abcde")
    return twins.read_body() and twins.next_cycle()


# Exchanges: method, request headers, status, response headers, whether a body is
# sent, whether the answer comes (and the backend hangs up) before the request ends.
exchanges_strategy = st.lists(
    st.tuples(st.sampled_from([b"POST", b"GET", b"HEAD", b"CONNECT"]), headers_strategy,
              st.sampled_from([200, 204, 304, 404, 101, 100]), headers_strategy,
              st.booleans(), st.booleans()),
    min_size=1, max_size=3)


@settings(max_examples=500, deadline=None)
@given(exchanges_strategy)
def test_a_client_connection_moves_as_h11_moves_it(exchanges):
    twins = Twins(h11.CLIENT)
    for exchange in exchanges:
        if not _client_exchange(twins, *exchange):
            break


def _server_exchange(twins: Twins, method: bytes, request_headers: list, status: int,
                     response_headers: list, send_body: bool, early: bool) -> bool:
    del early  # a client's early hang-up is h11's own path (receive_data(b""))
    target = b"a:443" if method == b"CONNECT" else b"/v1/chat/completions"
    lines = b"".join(b"%s: %s\r\n" % pair for pair in [(b"host", b"x"), *request_headers])
    data = b"%s %s HTTP/1.1\r\n%s\r\nabcde" % (method, target, lines)

    def theirs_request(conn: h11.Connection) -> Any:
        conn.receive_data(data)
        return conn.next_event()
    if not twins.step("request", lambda c: h11_internals.receive_request(c, data),
                      theirs_request):
        return False
    if not twins.read_body():
        return False
    if status < 200:
        return twins.step("informational",
                          lambda c: c.send(h11_internals.informational(status, response_headers,
                                                                       b"X")),
                          lambda c: c.send(h11.InformationalResponse(
                              status_code=status, headers=response_headers, reason=b"X")))
    if not twins.step("response",
                      lambda c: h11_internals.send_response(
                          c, h11_internals.response(status, response_headers, b"OK")),
                      lambda c: c.send(h11.Response(status_code=status, headers=response_headers,
                                                    reason=b"OK"))):
        return False
    if send_body and not twins.send_body():
        return False
    return twins.end() and twins.next_cycle()


@settings(max_examples=500, deadline=None)
@given(exchanges_strategy)
def test_a_server_connection_moves_as_h11_moves_it(exchanges):
    twins = Twins(h11.SERVER)
    for exchange in exchanges:
        if not _server_exchange(twins, *exchange):
            break


# The plain exchange itself, spelled out: the one the hot path makes, and the
# short way taken for each of its moves.

PLAIN_REQUEST = [(b"host", b"127.0.0.1:8100"), (b"content-type", b"application/json"),
                 (b"content-length", b"5")]
PLAIN_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5\r\n\r\n"


@pytest.mark.parametrize("cycles", [1, 3])
def test_the_plain_leg_moves_as_h11_moves_it(cycles):
    twins = Twins(h11.CLIENT)
    for _ in range(cycles):
        assert _client_exchange(twins, b"POST", PLAIN_REQUEST[1:], 200,
                                [(b"content-length", b"5")], True)
    assert twins.ours.our_state is h11.IDLE and twins.ours.their_state is h11.IDLE


def test_the_plain_moves_do_not_call_process_event(monkeypatch):
    conn = h11.Connection(h11.CLIENT)
    calls: list[object] = []
    monkeypatch.setattr(conn, "_process_event", lambda role, event: calls.append(event))
    h11_internals.send_request(conn, b"POST", b"/v1/completions", PLAIN_REQUEST)
    h11_internals.send_data(conn, b"abcde")
    h11_internals.send_end(conn)
    h11_internals.receive_head(conn, PLAIN_ANSWER)
    conn.receive_data(b"abcde")
    assert bytes(h11_internals.next_event(conn).data) == b"abcde"
    assert type(h11_internals.next_event(conn)) is h11.EndOfMessage
    h11_internals.start_next_cycle(conn)
    assert calls == []
    assert conn.our_state is h11.IDLE and conn.their_state is h11.IDLE


@pytest.mark.parametrize("header", [(b"connection", b"close"), (b"upgrade", b"h2c"),
                                    (b"expect", b"100-continue")])
def test_a_head_h11_acts_on_goes_through_process_event(monkeypatch, header):
    conn = h11.Connection(h11.CLIENT)
    seen: list[object] = []
    real = conn._process_event
    monkeypatch.setattr(conn, "_process_event",
                        lambda role, event: (seen.append(type(event)), real(role, event)))
    h11_internals.send_request(conn, b"POST", b"/", [*PLAIN_REQUEST, header])
    assert seen == [h11.Request]


def test_a_refused_end_leaves_the_connection_in_error_as_h11_does():
    twins = Twins(h11.CLIENT)
    assert twins.step("request",
                      lambda c: h11_internals.send_request(c, b"POST", b"/", PLAIN_REQUEST),
                      lambda c: c.send(h11.Request(method=b"POST", target=b"/",
                                                   headers=PLAIN_REQUEST)))
    # Two of the five bytes declared: the end is refused, and both sides are in ERROR.
    assert twins.step("data", lambda c: h11_internals.send_data(c, b"ab"),
                      lambda c: c.send(h11.Data(data=b"ab")))
    assert not twins.end()
    assert twins.ours.our_state is h11.ERROR


def test_a_cycle_not_done_is_refused_as_h11_refuses_it():
    assert not Twins(h11.SERVER).next_cycle()


@pytest.mark.parametrize("headers", [
    [(b"Host", b"x"), (b"Content-Length", b"12")],
    [(b"host", b"x"), (b"transfer-encoding", b"chunked")],
    [(b"host", b"x"), (b"content-length", b"1"), (b"content-length", b"1")],
    [(b"host", b"x"), (b"content-length", b"1, 1")],
    [(b"host", b"x"), (b"Transfer-Encoding", b"CHUNKED")],
    [(b"host", b"x"), (b"content-length", b"1"), (b"content-length", b"2")],
    [(b"host", b"x"), (b"transfer-encoding", b"gzip")],
    [(b"host", b"x"), (b"content-length", b"x")],
    [(b"host", b"x"), (b"content-length", b"1" * 21)],
])
def test_headers_normalise_as_h11_normalises_them(headers):
    from h11._headers import normalize_and_validate

    got = outcome(lambda: _normalized(headers)._full_items)
    want = outcome(lambda: normalize_and_validate(headers, _parsed=True)._full_items)
    assert got == want
