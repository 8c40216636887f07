"""Receiving on an h11 connection: the heads backends and clients send read by one
regex, a length-framed body's pieces without the state machine's round trip (see
the package's docstring, and its fence tests)."""

from __future__ import annotations

import re
from typing import Any

import h11
from h11._readers import ContentLengthReader

from .events import Headers, _normalized, _request_event, _response_event
from .moves import END_OF_MESSAGE, _process

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
        _process(conn, conn.their_role, event)
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
    if status < 100:  # not a status h11's events take: its parser says how
        return _read_by_h11(conn, head)
    try:
        headers = _normalized(_header_list(match[3]))
    except h11.LocalProtocolError:  # a framing h11 refuses: its parser says how
        return _read_by_h11(conn, head)
    event = _response_event(h11.Response if status >= 200 else h11.InformationalResponse,
                            status, headers, match[2] or b"")
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
