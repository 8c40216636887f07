"""The heads the proxy builds, as h11's events (see the package's docstring for why
they are valid without h11's per-header checks)."""

from __future__ import annotations

import re
from typing import Any

import h11
from h11._headers import Headers as _Headers
from h11._headers import normalize_and_validate

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
    normalized = _normalized(headers)
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
    """A final response head the proxy built: ``Response(..., _parsed=True)``."""
    if not 200 <= status < 1000:  # h11 refuses it, and says how
        return h11.Response(status_code=status, headers=headers, reason=reason,
                            http_version=b"1.1", _parsed=True)
    return _response_event(h11.Response, status, _normalized(headers), reason)


def _response_event(cls: type[Any], status: int, headers: _Headers, reason: bytes) -> Any:
    """``cls(..., _parsed=True)`` for a status in ``cls``'s range: the fields its
    ``__init__`` sets (fenced), with nothing left to check."""
    event = _new_event(cls)
    _set_field(event, "headers", headers)
    _set_field(event, "http_version", b"1.1")
    _set_field(event, "reason", reason)
    _set_field(event, "status_code", status)
    return event


# What normalize_and_validate passes as it is: one Content-Length of digits (h11
# 0.16 takes at most 20), at most one Transfer-Encoding, exactly "chunked".
_PLAIN_LENGTH = re.compile(rb"[0-9]{1,20}")


def _normalized(headers: Headers) -> _Headers:
    """``normalize_and_validate(headers, _parsed=True)``: the same ``Headers``,
    and for anything but a plain framing (a second or listed Content-Length, a
    Transfer-Encoding other than one ``chunked``) its own answer or refusal."""
    items = []
    length = chunked = False
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            if length or _PLAIN_LENGTH.fullmatch(value) is None:
                return normalize_and_validate(headers, _parsed=True)
            length = True
        elif lowered == b"transfer-encoding":
            if chunked or value != b"chunked":
                return normalize_and_validate(headers, _parsed=True)
            chunked = True
        items.append((name, lowered, value))
    return _Headers(items)


def informational(status: int, headers: Headers, reason: bytes) -> h11.InformationalResponse:
    """A 1xx head the proxy relays or writes."""
    return h11.InformationalResponse(status_code=status, headers=headers, reason=reason,
                                     http_version=b"1.1", _parsed=True)
