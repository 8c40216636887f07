"""The client's request body: parsed once, and stripped of the fields the proxy owns.

No I/O here. A client must never steer where a decode server pulls KV from
(a vLLM connector connects wherever kv_transfer_params say), so the fields
that would let it are removed before planning, whatever the route.
"""

from __future__ import annotations

from typing import Any

from .._types import KV, Body
from ..lax_types import is_true
from . import strict_json
from .strict_json import MAX_DEPTH

PROXY_OWNED_FIELDS: tuple[tuple[str, ...], ...] = (
    (KV,),
    ("vllm_xargs", KV),
    ("sampling_params", "extra_args", KV),
    ("bootstrap_host",),
    ("bootstrap_port",),
    ("bootstrap_room",),
)
"""Body fields only the proxy may set, as key paths; a client's are dropped on every route.

- ``kv_transfer_params``: tells a vLLM connector where to pull KV from
  (``remote_host``, ``remote_bootstrap_addr``, ...).
- ``vllm_xargs.kv_transfer_params``: vLLM copies ``vllm_xargs`` into the sampling
  params' ``extra_args`` after the top-level field, so it would override the
  proxy's; the other ``vllm_xargs`` keys are the client's and kept.
- ``sampling_params.extra_args.kv_transfer_params``: the same place, reached
  directly through ``/inference/v1/generate``'s ``sampling_params`` (inferred
  from vLLM's SamplingParams, which carries ``extra_args``).
- ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``: SGLang's PD
  meeting point; the sglang handshake sets its own on both legs.
"""

# The top-level keys of the paths above: a body without any of them (the common
# case) costs one set test.
_OWNED_TOP_LEVEL = frozenset(path[0] for path in PROXY_OWNED_FIELDS)

TOO_DEEP = f"JSON body nested deeper than {MAX_DEPTH} levels"
# vLLM's request models have under a hundred fields; each leg copies and
# serialises the body's top level field by field, so a body of millions of
# fields (still under PD_PROXY_MAX_BODY_BYTES) would hold the event loop for
# seconds. No API's request needs more than this.
MAX_FIELDS = 1024
TOO_MANY_FIELDS = f"JSON body has more than {MAX_FIELDS} top-level fields"
TOO_MANY_CONTAINERS = (f"JSON body has more than {strict_json.MAX_CONTAINERS} arrays and "
                       "objects")


class BodyError(ValueError):
    """The client's body is not a usable JSON object; the message is the client's answer."""


def parse_client_body(raw: bytes) -> Body:
    """Parse the client's body once. An empty body counts as {} (as in the GCO proxy).

    Only RFC 8259 JSON nested at most MAX_DEPTH deep (strict_json), which the
    legs can serialise again.
    """
    if not raw:
        return {}
    try:
        decoded = strict_json.loads(raw)
    except strict_json.TooDeep:
        raise BodyError(TOO_DEEP) from None
    except strict_json.TooMany:
        raise BodyError(TOO_MANY_CONTAINERS) from None
    except strict_json.NotJson:
        raise BodyError("invalid JSON body") from None
    if not isinstance(decoded, dict):
        raise BodyError("JSON body must be an object")
    if len(decoded) > MAX_FIELDS:
        raise BodyError(TOO_MANY_FIELDS)
    return decoded


def without_proxy_owned(body: Body) -> Body:
    """The client's body minus every PROXY_OWNED_FIELDS entry; the original is not changed.

    A client-set remote_bootstrap_addr or remote_host would make the decode
    server connect wherever the client likes, so what the client sent never
    reaches either leg. Only the containers on a dropped field's path are
    copied.
    """
    if _OWNED_TOP_LEVEL.isdisjoint(body):
        return body
    body = dict(body)
    for path in PROXY_OWNED_FIELDS:
        _drop(body, path)
    return body


def _drop(container: dict[str, Any], path: tuple[str, ...]) -> None:
    """Remove ``path`` from ``container`` (already a copy), copying inner dicts it crosses."""
    key, rest = path[0], path[1:]
    if key not in container:
        return
    if not rest:
        del container[key]
        return
    inner = container[key]
    if isinstance(inner, dict) and rest[0] in inner:
        container[key] = inner = dict(inner)
        _drop(inner, rest)


# The name the proxy has called since the KV fields were split out of legs.py.
without_client_kv = without_proxy_owned


def wants_stream(body: Body) -> bool:
    """Whether decode will stream: ``stream`` as vLLM's pydantic reads it (lax bool:
    true, 1, "true", "yes", "on"...). The GCO proxy's truthiness labelled the JSON
    answer to ``"stream": "false"`` an event stream; values pydantic refuses are
    400 before this (request_models.py)."""
    return is_true(body.get("stream"))
