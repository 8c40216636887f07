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

Relied on, each pinned by tests/downstream/test_h11_fence.py:

- ``Request``, ``Response`` and ``InformationalResponse`` take ``_parsed``;
  with it they skip the regexes and ``bytesify`` and keep everything else
  (values must then be bytes, the status an int);
- ``Connection.send`` of such an event writes the bytes the validated event
  would, and moves the state machine the same way.

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


def informational(status: int, headers: Headers, reason: bytes) -> h11.InformationalResponse:
    """A 1xx head the proxy relays or writes."""
    return h11.InformationalResponse(status_code=status, headers=headers, reason=reason,
                                     http_version=b"1.1", _parsed=True)
