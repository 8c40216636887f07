"""Every h11 internal lowproxy relies on, named here and nowhere else.

h11 validates each event it is asked to send: the method, target and reason
against its grammar, each header name and value against two regexes. That is
a third of the proxy's h11 time per request (issue 21), and checks nothing
the proxy does not already guarantee for the heads built here:

- names and values relayed from a client or a backend went through h11's
  parser, which ran the same regexes on them when it read them;
- everything else is the proxy's own literals, numbers it formats, ids it
  generates (ids.py), and the backend key, which keys.py refuses at read when
  it holds a byte a header value cannot carry.

So these heads are built with h11's ``_parsed=True``: what its parser passes
for heads it read. The framing checks stay (``normalize_and_validate`` still
lowercases names and checks Content-Length and Transfer-Encoding under
``_parsed``), and the events go through ``Connection.send``, so h11's state
machine, its framing and its keep-alive decisions are exactly as before.

``Connection.send`` would undo that for a final response: it passes every
``Response`` through ``_clean_up_response_headers_for_sending``, which fixes
the framing and Connection headers and then builds the event again *without*
``_parsed`` (every header through the regexes once more: most of the cost of
a response head). ``send_response`` skips that rebuild when it would change
nothing, or makes the one change itself (``Transfer-Encoding: chunked`` for
a body of unknown length to an HTTP/1.1 client), and otherwise calls
``send``. Likewise ``send_data``: a piece of a body already under way moves
no state (SEND_BODY to SEND_BODY), so it goes straight to the body's writer
(which still counts it against the Content-Length) without a trip through
the state machine, a third of what ``send`` costs for it.

Relied on, each pinned by tests/downstream/test_h11_fence.py:

- ``Request``, ``Response`` and ``InformationalResponse`` take ``_parsed``;
  with it they skip the regexes and ``bytesify`` and keep everything else
  (values must then be bytes, the status an int);
- ``Connection.send`` of such an event writes the bytes the validated event
  would, and moves the state machine the same way;
- ``Connection._cstate.keep_alive``, ``Connection._request_method``,
  ``Connection._writer``, ``Connection._process_event`` and
  ``Connection._process_error``: what ``send_with_data_passthrough`` does
  with a response once it is cleaned up, and what decides the clean-up.

The upper bound on h11 in pyproject.toml stays below a release that changes
any of them until this module is adapted.
"""

from __future__ import annotations

import h11

Headers = list[tuple[bytes, bytes]]


def request(method: bytes, target: bytes, headers: Headers) -> h11.Request:
    """A request head the proxy built (see the module's docstring for why it is valid)."""
    return h11.Request(method=method, target=target, headers=headers, http_version=b"1.1",
                       _parsed=True)


def response(status: int, headers: Headers, reason: bytes) -> h11.Response:
    """A final response head the proxy built."""
    return h11.Response(status_code=status, headers=headers, reason=reason,
                        http_version=b"1.1", _parsed=True)


def send_response(conn: h11.Connection, event: h11.Response) -> bytes:
    """``conn.send(event)`` for a final head the proxy built, without h11's rebuild.

    The same bytes and the same state changes as ``send`` (the fence test
    compares them case by case); only the re-validation of headers the proxy
    already guarantees is skipped.
    """
    if not conn._cstate.keep_alive or conn.their_http_version != b"1.1":
        return conn.send(event)  # the clean-up adds Connection: close, or drops chunking
    # A HEAD response carries the framing headers a GET's would (h11's rule).
    status = event.status_code
    if not (status in (204, 304) or (conn._request_method == b"CONNECT" and 200 <= status < 300)):
        length = False
        for _, name, _ in event.headers._full_items:
            if name == b"transfer-encoding":
                return conn.send(event)  # the clean-up rewrites it
            if name == b"content-length":
                length = True
        if not length:  # what the clean-up would make of it: chunked, appended last
            event = response(status, [*event.headers.raw_items(),
                                      (b"Transfer-Encoding", b"chunked")], event.reason)
    if conn.our_state is h11.ERROR:
        raise h11.LocalProtocolError("Can't send data when our state is ERROR")
    try:
        writer = conn._writer
        conn._process_event(conn.our_role, event)
        assert writer is not None  # h11 raised above when there is none
        out: list[bytes] = []
        writer(event, out.append)
    except BaseException:
        conn._process_error(conn.our_role)
        raise
    return b"".join(out)


def send_data(conn: h11.Connection, data: bytes) -> bytes:
    """``conn.send(h11.Data(data=data))``, the same bytes and states (fenced)."""
    if conn.our_state is not h11.SEND_BODY:
        return conn.send(h11.Data(data=data))  # h11 refuses it, or a state of its own
    out: list[bytes] = []
    try:
        conn._writer(h11.Data(data=data), out.append)  # type: ignore[misc]
    except BaseException:
        conn._process_error(conn.our_role)
        raise
    if conn.our_role is h11.CLIENT:  # what _process_event does for a client's Data
        conn.client_is_waiting_for_100_continue = False
    return b"".join(out)


def informational(status: int, headers: Headers, reason: bytes) -> h11.InformationalResponse:
    """A 1xx head the proxy relays or writes."""
    return h11.InformationalResponse(status_code=status, headers=headers, reason=reason,
                                     http_version=b"1.1", _parsed=True)
