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

Relied on, each pinned by tests/downstream/test_h11_fence.py (and the state
machine's moves by tests/downstream/test_h11_moves.py):

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
  ``receive_head`` below;
- ``Response``'s and ``InformationalResponse``'s fields (``headers``,
  ``http_version``, ``reason``, ``status_code``), set as their ``__init__``
  sets them, and ``h11._headers.Headers`` built from its triples, for the
  heads built here without ``normalize_and_validate`` when their framing is
  plain (``_normalized``);
- ``Connection._cstate`` (``states``, ``keep_alive``,
  ``pending_switch_proposals``), ``our_role``, ``their_role``,
  ``their_http_version``, ``client_is_waiting_for_100_continue`` and the
  ``READERS`` and ``WRITERS`` tables of ``h11._readers`` and ``h11._writers``:
  what ``_process_event`` and ``start_next_cycle`` change for the events of a
  plain keep-alive exchange, which ``_process`` and ``start_next_cycle``
  below change the same way (the moves section says which events).

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

from .complaints import without_quoted_bytes
from .events import informational, request, response
from .moves import (
           END_OF_MESSAGE,
           send_data,
           send_end,
           send_request,
           send_response,
           start_next_cycle,
)
from .reads import BLANK_LINE, next_event, receive_head, receive_request

__all__ = ["BLANK_LINE", "END_OF_MESSAGE", "informational", "next_event", "receive_head",
           "receive_request", "request", "response", "send_data", "send_end", "send_request",
           "send_response", "start_next_cycle", "without_quoted_bytes"]
