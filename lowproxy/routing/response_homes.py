"""Which decode holds a stored response, read from the response's id alone.

vLLM keeps a Responses answer (``store``, the default; ``background``) in the
memory of the server that made it, and only that server answers
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and a request
whose ``previous_response_id`` names it (404 anywhere else). With several
decodes, sending those to the least loaded one failed about half the time.

vLLM's response id is the request's ``request_id`` field (a vLLM extra,
``resp_<uuid4 hex>`` when absent). So lowproxy names it on every Responses
decode leg whose client did not: ``resp_`` + 24 random hex digits + 8 naming
the decode (a crc32 of its label), the same shape as vLLM's own. Any replica
or worker, or the same one after a restart, finds the decode from the id, with
no state shared or kept. The random part is the id's secret (whoever knows an
id may read the response: vLLM checks nothing more), so it comes from the
OS's random source, 96 bits, never from the counter-based correlation ids.

An id lowproxy did not make (a client's own ``request_id``, an answer from
before) names no decode: it goes to the least loaded one, as before.
"""

from __future__ import annotations

import secrets
import zlib
from typing import Sequence

from ..upstream.endpoint import Endpoint

PREFIX = "resp_"
_RANDOM_HEX = 24
_TAG_HEX = 8
ID_LENGTH = len(PREFIX) + _RANDOM_HEX + _TAG_HEX  # 37, as vLLM's resp_<32 hex>
RESPONSES_PATH = "/v1/responses/"


def decode_tag(label: str) -> str:
    """The 8 hex digits naming a decode in the ids made for it: the same in every
    process (crc32, not the per-process hash())."""
    return f"{zlib.crc32(label.encode()):08x}"


def placeholder() -> str:
    """The id put in the client's body before a decode is chosen: replaced, for each
    decode leg sent, by ``id_for`` that decode. Random, so no prompt contains it."""
    return PREFIX + secrets.token_hex((_RANDOM_HEX + _TAG_HEX) // 2)


def id_for(endpoint: Endpoint) -> str:
    """A new response id that names ``endpoint``: fresh for every decode leg, so a
    leg sent again (another decode, or the same after a failed prefill) never
    repeats a request id the engine may still hold."""
    return PREFIX + secrets.token_hex(_RANDOM_HEX // 2) + decode_tag(endpoint.label)


def home_of(response_id: object, endpoints: Sequence[Endpoint]) -> Endpoint | None:
    """The decode among ``endpoints`` whose store holds ``response_id``, if the id
    was made by ``id_for``; else None."""
    if not isinstance(response_id, str) or len(response_id) != ID_LENGTH \
            or not response_id.startswith(PREFIX):
        return None
    tag = response_id[-_TAG_HEX:]
    for endpoint in endpoints:
        if decode_tag(endpoint.label) == tag:
            return endpoint
    return None


def id_in_path(path: str) -> str | None:
    """The response id of ``/v1/responses/{id}`` and of the paths below it
    (``/cancel``, ``/input_items``); else None."""
    if not path.startswith(RESPONSES_PATH):
        return None
    found = path[len(RESPONSES_PATH):].split("/", 1)[0]
    return found or None
