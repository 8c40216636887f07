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

- ``Request``'s fields are ``method``, ``headers`` (what
  ``h11._headers.normalize_and_validate`` returns, its ``_full_items``
  triples), ``target`` and ``http_version``, set
  with ``object.__setattr__`` (a frozen dataclass) as its ``__init__`` does;
- ``Request``, ``Response`` and ``InformationalResponse`` take ``_parsed``;
  with it they skip the regexes and ``bytesify`` and keep everything else
  (values must then be bytes, the status an int);
- ``Connection.send`` of such an event writes the bytes the validated event
  would, and moves the state machine the same way;
- ``Connection._cstate.keep_alive``, ``Connection._request_method``,
  ``Connection._writer``, ``Connection._process_event`` and
  ``Connection._process_error``: what ``send_with_data_passthrough`` does
  with a response once it is cleaned up, and what decides the clean-up;
- ``Connection._reader``, ``h11._readers.ContentLengthReader`` (its
  ``_remaining``, what it returns) and ``ReceiveBuffer.maybe_extract_at_most``,
  for ``next_event`` below;
- ``Connection._receive_buffer`` and what ``next_event`` does with an event
  its reader made (``_process_event`` for their role, ``_process_error`` and
  ``_reraise_as_remote_protocol_error`` when that fails), for
  ``receive_head`` below.

Receiving, ``receive_head`` takes a backend's response head (cut at its blank
line) the way ``receive_data`` and ``next_event`` would, and
``receive_request`` a client's first read of a request, for the heads every
backend and client library sends: HTTP/1.1, CRLF line ends, no folded lines, visible bytes in
names and values. In that subset of h11's grammar its parse is a split on
CRLF and on each line's first colon, values stripped of spaces and tabs,
which one regex over the whole head checks at C speed; the event is built
with ``_parsed`` and goes through h11's state machine as its reader's would.
Anything else (HTTP/1.0, bare LF, obs-fold, a control byte, a framing h11
refuses, a head not whole in the first read) goes to h11's own parser, which
decides. Half of what h11 spends on a head is its line splitting and per-line
regexes (three heads per request). The request's own checks (Host, its
framing, Expect, Upgrade) are h11's: ``Request`` and ``_process_event`` make
them.

The upper bound on h11 in pyproject.toml stays below a release that changes
any of them until this module is adapted.
"""

from __future__ import annotations

import re
from typing import Any

import h11
from h11._headers import normalize_and_validate
from h11._readers import ContentLengthReader

Headers = list[tuple[bytes, bytes]]


# h11/_abnf.py's method (a token) and request target (visible ASCII).
_METHOD = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_new_event = object.__new__
_set_field = object.__setattr__  # h11's events are frozen dataclasses


def request(method: bytes, target: bytes, headers: Headers) -> h11.Request:
    """A request head the proxy built (see the module's docstring for why it is valid).

    ``Request.__init__`` counts Host headers by iterating ``Headers`` item by
    item (through ``Sequence.__iter__``), a third of its cost. Here the fields
    are set as ``__init__`` sets them (fenced) and its rules kept, checked on
    the plain list: the framing checks of ``normalize_and_validate``, exactly
    one Host, the method and target grammars."""
    if _METHOD.fullmatch(method) is None or _TARGET.fullmatch(target) is None:
        raise h11.LocalProtocolError("Illegal method or target characters")
    return _request_event(method, target, headers)


def _request_event(method: bytes, target: bytes, headers: Headers) -> h11.Request:
    """``Request(..., _parsed=True)`` for a method and target known to match h11's grammar."""
    normalized = normalize_and_validate(headers, _parsed=True)
    hosts = 0
    for _, name, _ in normalized._full_items:
        if name == b"host":
            hosts += 1
    if hosts != 1:
        raise h11.LocalProtocolError("Missing mandatory Host: header" if not hosts
                                     else "Found multiple Host: headers")
    event = _new_event(h11.Request)
    _set_field(event, "method", method)
    _set_field(event, "headers", normalized)
    _set_field(event, "target", target)
    _set_field(event, "http_version", b"1.1")
    return event


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


# A response head in the part of h11's grammar (h11/_abnf.py) where its parse
# is a split: HTTP/1.1, a three-digit status, a reason of visible bytes,
# spaces and tabs; header lines of a token, a colon and a value of visible
# bytes (obs-text included) separated by spaces or tabs, each ended by CRLF;
# the blank line. Every head this matches, h11 reads into the same event.
_HEADER_LINES = (rb"((?:[-!#$%&'*+.^_`|~0-9a-zA-Z]+:[ \t]*"
                 rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?[ \t]*\r\n)*)\r\n")
_PLAIN_RESPONSE_HEAD = re.compile(
    rb"HTTP/1\.1 ([0-9]{3})(?: ([\t\x20-\x7e\x80-\xff]*))?\r\n" + _HEADER_LINES)


# A request head likewise: a token method, a target of visible ASCII, HTTP/1.1.
_PLAIN_REQUEST_HEAD = re.compile(
    rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+) ([\x21-\x7e]+) HTTP/1\.1\r\n" + _HEADER_LINES)
# Where h11 ends a head: the first empty line, with or without its CR.
BLANK_LINE = re.compile(rb"\n\r?\n")


def _header_list(block: bytes) -> Headers:
    headers = []
    if block:
        for line in block[:-2].split(b"\r\n"):
            name, _, value = line.partition(b":")
            headers.append((name, value.strip(b" \t")))
    return headers


def _received(conn: h11.Connection, event: h11._events.Event) -> None:
    try:
        conn._process_event(conn.their_role, event)
    except BaseException as exc:  # as next_event does
        conn._process_error(conn.their_role)
        if isinstance(exc, h11.LocalProtocolError):
            exc._reraise_as_remote_protocol_error()
        raise


def _read_by_h11(conn: h11.Connection, data: bytes) -> Any:
    """What the fast reads below stand for, and fall back to."""
    conn.receive_data(data)
    return conn.next_event()


def receive_head(conn: h11.Connection, head: bytes) -> Any:
    """``conn.receive_data(head)`` then ``conn.next_event()``, for a response head
    cut at its blank line: the same event, states and errors (fenced)."""
    match = _PLAIN_RESPONSE_HEAD.fullmatch(head)
    if match is None or conn._receive_buffer or conn.their_state is not h11.SEND_RESPONSE:
        return _read_by_h11(conn, head)
    status = int(match[1])
    try:
        event: h11.Response | h11.InformationalResponse = (
            h11.Response if status >= 200 else h11.InformationalResponse)(
            status_code=status, headers=_header_list(match[3]), reason=match[2] or b"",
            http_version=b"1.1", _parsed=True)
    except h11.LocalProtocolError:  # a framing or status h11 refuses: its parser says how
        return _read_by_h11(conn, head)
    _received(conn, event)
    return event


def receive_request(conn: h11.Connection, data: bytes) -> Any:
    """``conn.receive_data(data)`` then ``conn.next_event()`` on a server
    connection waiting for a request: the same event, states, errors and bytes
    left for the body (fenced)."""
    if not data or conn._receive_buffer or conn.their_state is not h11.IDLE:
        return _read_by_h11(conn, data)
    blank = BLANK_LINE.search(data)
    if blank is None:
        return _read_by_h11(conn, data)
    end = blank.end()
    match = _PLAIN_REQUEST_HEAD.fullmatch(data, 0, end)
    if match is None:
        return _read_by_h11(conn, data)
    try:
        event = _request_event(match[1], match[2], _header_list(match[3]))
    except h11.LocalProtocolError:  # no Host, a framing h11 refuses: its parser says how
        return _read_by_h11(conn, data)
    _received(conn, event)
    if end < len(data):
        conn.receive_data(data[end:])
    return event


# Shared: h11 never keeps or changes an event it is handed or hands out.
END_OF_MESSAGE = h11.EndOfMessage()
_ContentLengthReader = ContentLengthReader


def next_event(conn: h11.Connection) -> Any:
    """``conn.next_event()``: the same events, states and errors (fenced).

    While a Content-Length body is read (SEND_BODY, h11's
    ``ContentLengthReader``), a piece of it changes no state, so it is taken
    from h11's buffer by the reader's own rule without the round trip through
    the state machine (as ``send_data`` does sending), and the end goes
    through ``_process_event`` as ``next_event`` would send it; everything
    else is ``next_event`` itself."""
    reader = conn._reader
    if type(reader) is not _ContentLengthReader or conn.their_state is not h11.SEND_BODY:
        return conn.next_event()
    if reader._remaining == 0:
        _received(conn, END_OF_MESSAGE)
        return END_OF_MESSAGE
    data = conn._receive_buffer.maybe_extract_at_most(reader._remaining)
    if data is None:  # NEED_DATA, or the peer closed mid-body: h11 says which
        return conn.next_event()
    reader._remaining -= len(data)
    if conn.their_role is h11.CLIENT:  # what _process_event does for a client's Data
        conn.client_is_waiting_for_100_continue = False
    return h11.Data(data=data)  # type: ignore[arg-type]  # a bytearray, as h11 hands out
