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
  with a response once it is cleaned up, and what decides the clean-up;
- ``Connection._receive_buffer`` and what ``next_event`` does with an event
  its reader made (``_process_event`` for their role, ``_process_error`` and
  ``_reraise_as_remote_protocol_error`` when that fails), for
  ``receive_head`` below.

Receiving, ``receive_head`` takes a backend's response head (cut at its blank
line) the way ``receive_data`` and ``next_event`` would, for the heads every
backend sends: HTTP/1.1, CRLF line ends, no folded lines, visible bytes in
names and values. In that subset of h11's grammar its parse is a split on
CRLF and on each line's first colon, values stripped of spaces and tabs,
which one regex over the whole head checks at C speed; the event is built
with ``_parsed`` and goes through h11's state machine as its reader's would.
Anything else (HTTP/1.0, bare LF, obs-fold, a control byte, a framing h11
refuses) goes to h11's own parser, which decides. Half of what h11 spends on
a head is its line splitting and per-line regexes (two heads per request).

The upper bound on h11 in pyproject.toml stays below a release that changes
any of them until this module is adapted.
"""

from __future__ import annotations

import re

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


# A response head in the part of h11's grammar (h11/_abnf.py) where its parse
# is a split: HTTP/1.1, a three-digit status, a reason of visible bytes,
# spaces and tabs; header lines of a token, a colon and a value of visible
# bytes (obs-text included) separated by spaces or tabs, each ended by CRLF;
# the blank line. Every head this matches, h11 reads into the same event.
_PLAIN_RESPONSE_HEAD = re.compile(
    rb"HTTP/1\.1 ([0-9]{3})(?: ([\t\x20-\x7e\x80-\xff]*))?\r\n"
    rb"((?:[-!#$%&'*+.^_`|~0-9a-zA-Z]+:[ \t]*"
    rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?[ \t]*\r\n)*)\r\n")


def receive_head(conn: h11.Connection, head: bytes) -> object:
    """``conn.receive_data(head)`` then ``conn.next_event()``, for a response head
    cut at its blank line: the same event, states and errors (fenced)."""
    match = _PLAIN_RESPONSE_HEAD.fullmatch(head)
    if match is None or conn._receive_buffer or conn.their_state is not h11.SEND_RESPONSE:
        conn.receive_data(head)
        return conn.next_event()
    status = int(match[1])
    headers = []
    block = match[3]
    if block:
        for line in block[:-2].split(b"\r\n"):
            name, _, value = line.partition(b":")
            headers.append((name, value.strip(b" \t")))
    try:
        event: h11.Response | h11.InformationalResponse = (
            h11.Response if status >= 200 else h11.InformationalResponse)(
            status_code=status, headers=headers, reason=match[2] or b"",
            http_version=b"1.1", _parsed=True)
    except h11.LocalProtocolError:  # a framing or status h11 refuses: its parser says how
        conn.receive_data(head)
        return conn.next_event()
    try:
        conn._process_event(conn.their_role, event)
    except BaseException as exc:  # as next_event does
        conn._process_error(conn.their_role)
        if isinstance(exc, h11.LocalProtocolError):
            exc._reraise_as_remote_protocol_error()
        raise
    return event
