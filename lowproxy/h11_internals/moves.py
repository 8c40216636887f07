"""Sending on an h11 connection, and the state machine's common moves made in a few
steps (see the package's docstring, and its fence tests)."""

from __future__ import annotations

from typing import Any

import h11
from h11._readers import READERS
from h11._writers import WRITERS

from .events import Headers, request, response

# Shared: h11 never keeps or changes an event it is handed or hands out.
END_OF_MESSAGE = h11.EndOfMessage()

# -- the state machine's common moves
#
# Connection._process_event runs every event through h11's general machinery:
# two copies of the state dict, the switch-proposal and keep-alive rules, a
# fixed-point loop over the state-triggered transitions, and for a head the
# framing read again from its headers by three list scans. For the events of a
# plain keep-alive exchange (no protocol switch proposed, no Connection: close,
# Upgrade or Expect header, HTTP/1.1) all of that comes to a few assignments:
# the event-triggered transition, the reader or writer of the new state, and
# the flags _process_event sets. ``_process`` makes those and leaves every
# other case to ``_process_event``; the fence test compares the two on twin
# connections, state by state.

_CLIENT, _SERVER = h11.CLIENT, h11.SERVER
_Request, _Response, _EndOfMessage = h11.Request, h11.Response, h11.EndOfMessage
_IDLE, _SEND_RESPONSE, _SEND_BODY, _DONE = h11.IDLE, h11.SEND_RESPONSE, h11.SEND_BODY, h11.DONE
_PEER = {_CLIENT: _SERVER, _SERVER: _CLIENT}
# The peer states in which a side's EndOfMessage triggers nothing more (h11's
# STATE_TRIGGERED_TRANSITIONS start from CLOSED, ERROR and the switch states).
_QUIET_PEER = (_SEND_RESPONSE, _SEND_BODY, _DONE)
# h11's tables mix a state's reader or writer with SEND_BODY's table of factories.
_READERS: dict[Any, Any] = READERS
_WRITERS: dict[Any, Any] = WRITERS
_BODY_READERS: dict[str, Any] = _READERS[_SEND_BODY]
_BODY_WRITERS: dict[str, Any] = _WRITERS[_SEND_BODY]
# Headers whose presence _process_event acts on (a switch proposal, 100-continue);
# Connection is read for "close", as _keep_alive does.
_ACTED_ON = (b"upgrade", b"expect")


def _body_io(io: dict[str, Any], request_method: bytes | None, event: Any) -> Any:
    """h11's ``_body_framing`` made into the reader or writer, for a head whose
    headers were normalised; None for one ``_process_event`` must see (it acts
    on one of its headers)."""
    chunked = False
    length = None
    for _, name, value in event.headers._full_items:
        if name == b"content-length":
            length = value
        elif name == b"transfer-encoding":
            chunked = True  # normalised: one, and "chunked"
        elif name == b"connection":
            if b"close" in [item.strip().lower() for item in value.split(b",")]:
                return None
        elif name in _ACTED_ON:
            return None
    if type(event) is _Response:
        status = event.status_code
        if status in (204, 304) or request_method == b"HEAD" or (
                request_method == b"CONNECT" and 200 <= status < 300):
            return io["content-length"](0)
        if chunked:
            return io["chunked"]()
        return io["content-length"](int(length)) if length is not None else io["http/1.0"]()
    if chunked:
        return io["chunked"]()
    return io["content-length"](int(length) if length is not None else 0)


def _process(conn: h11.Connection, role: Any, event: Any) -> None:
    """``conn._process_event(role, event)``: the same states, reader, writer and
    flags (fenced), in a few steps for a plain keep-alive exchange."""
    cstate = conn._cstate
    if cstate.keep_alive and not cstate.pending_switch_proposals:
        states = cstate.states
        kind = type(event)
        if kind is _EndOfMessage:
            if states[role] is _SEND_BODY and states[_PEER[role]] in _QUIET_PEER:
                states[role] = _DONE
                if role is _CLIENT:
                    conn.client_is_waiting_for_100_continue = False
                if role is conn.our_role:
                    conn._writer = _WRITERS.get((role, _DONE))
                else:
                    conn._reader = _READERS.get((role, _DONE))
                return
        elif kind is _Response:
            if (role is _SERVER and states[_SERVER] is _SEND_RESPONSE
                    and states[_CLIENT] in (_SEND_BODY, _DONE) and event.http_version == b"1.1"):
                ours = conn.our_role is _SERVER
                io = _body_io(_BODY_WRITERS if ours else _BODY_READERS, conn._request_method, event)
                if io is not None:
                    states[_SERVER] = _SEND_BODY
                    conn.client_is_waiting_for_100_continue = False
                    if ours:
                        conn._writer = io
                    else:
                        conn.their_http_version = b"1.1"
                        conn._reader = io
                    return
        elif kind is _Request:
            if (role is _CLIENT and states[_CLIENT] is _IDLE and states[_SERVER] is _IDLE
                    and event.http_version == b"1.1" and event.method != b"CONNECT"):
                ours = conn.our_role is _CLIENT
                io = _body_io(_BODY_WRITERS if ours else _BODY_READERS, None, event)
                if io is not None:
                    states[_CLIENT] = _SEND_BODY
                    states[_SERVER] = _SEND_RESPONSE
                    conn._request_method = event.method
                    if ours:
                        conn._writer = io
                        conn._reader = _READERS.get((_SERVER, _SEND_RESPONSE))
                    else:
                        conn.their_http_version = b"1.1"
                        conn._writer = _WRITERS.get((_SERVER, _SEND_RESPONSE))
                        conn._reader = io
                    return
    conn._process_event(role, event)


def _sent(conn: h11.Connection, event: Any) -> bytes:
    """``conn.send(event)`` for a Request or EndOfMessage: ``send_with_data_passthrough``
    with ``_process`` (fenced)."""
    if conn.our_state is h11.ERROR:
        raise h11.LocalProtocolError("Can't send data when our state is ERROR")
    try:
        writer = conn._writer
        _process(conn, conn.our_role, event)
        assert writer is not None  # h11 raised above when there is none
        out: list[bytes] = []
        writer(event, out.append)
    except BaseException:
        conn._process_error(conn.our_role)
        raise
    return b"".join(out)


def send_request(conn: h11.Connection, method: bytes, target: bytes, headers: Headers) -> bytes:
    """``conn.send(request(method, target, headers))``: the same bytes and states."""
    return _sent(conn, request(method, target, headers))


def send_end(conn: h11.Connection) -> bytes:
    """``conn.send(EndOfMessage())``: the same bytes and states (fenced)."""
    return _sent(conn, END_OF_MESSAGE)


_BOTH_DONE = {_CLIENT: _DONE, _SERVER: _DONE}


def start_next_cycle(conn: h11.Connection) -> None:
    """``conn.start_next_cycle()``: the same states, reader and writer (fenced)."""
    cstate = conn._cstate
    if (cstate.states != _BOTH_DONE or not cstate.keep_alive or cstate.pending_switch_proposals
            or conn.client_is_waiting_for_100_continue):
        conn.start_next_cycle()  # it refuses, or asserts
        return
    cstate.states = {_CLIENT: _IDLE, _SERVER: _IDLE}
    conn._request_method = None
    conn._writer = _WRITERS.get((conn.our_role, _IDLE))
    conn._reader = _READERS.get((conn.their_role, _IDLE))


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
    return _sent(conn, event)


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
