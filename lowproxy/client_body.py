"""The client's request body: parsed once, and stripped of the fields the proxy owns.

No I/O here. A client must never steer where a decode server pulls KV from
(shared/PROTOCOL.md), so the fields that would let it are removed before
planning, whatever the route.
"""

from __future__ import annotations

import json
from typing import Any

Body = dict[str, Any]

KV = "kv_transfer_params"


class BodyError(ValueError):
    """The client's body is not a usable JSON object; the message is the client's answer."""


def parse_client_body(raw: bytes) -> Body:
    """Parse the client's body once. An empty body counts as {} (as in the GCO proxy)."""
    if not raw:
        return {}
    try:
        decoded = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise BodyError("invalid JSON body") from None
    if not isinstance(decoded, dict):
        raise BodyError("JSON body must be an object")
    return decoded


def without_client_kv(body: Body) -> Body:
    """The client's body minus any kv_transfer_params it sent.

    A client-set remote_bootstrap_addr or remote_host would make the decode
    server connect wherever the client likes, so what the client sent never
    reaches either leg.
    """
    if KV in body:
        body = dict(body)
        del body[KV]
    return body


def wants_stream(body: Body) -> bool:
    # Truthiness, as the GCO proxy judged it (vLLM's pydantic also takes 1 for true).
    return bool(body.get("stream"))
