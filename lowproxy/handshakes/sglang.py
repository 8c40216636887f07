"""SGLang PD: the same body to both legs, plus where and under which room to meet.

An SGLang decode in disaggregation mode refuses every request without a
``bootstrap_room`` (its scheduler answers 400 "Disaggregated request received
without bootstrap room id"), so under this handshake every generation request
has both legs, whatever its shape: there is no decode alone, and no decode
that recomputes a prompt whose prefill failed.

A request SGLang expands into several (a list of prompts, token-id lists, or
``n`` > 1) is a batch to it (``GenerateReqInput.normalize_batch_and_arguments``):
each child needs a room of its own, and gets the rid ``<rid>_<i>``. A list of
rooms is taken index by index (and repeated ``n`` times, of which the first
``children`` are used), so the legs carry one room per child SGLang makes, as
SGLang's routers send one room per prompt. No I/O here.
"""

from __future__ import annotations

from typing import Any, Callable

from .._types import Body
from ..routes import CHAT, COMPLETIONS, RESPONSES, SGLANG_GENERATE
from ..upstream.endpoint import Endpoint
from .legs import Plan, serialise, sglang_body
from .sglang_logprobs import wants_merge

# A room is a non-negative int64 in SGLang; a random 63-bit integer each.
ROOM_BITS = 63
# The most requests SGLang may make of one (prompts x n) that lowproxy pairs: each
# needs a room (a random draw) and a rid of its own, made before either leg, so an
# unbounded n would hold the event loop and grow the process without end.
MAX_CHILDREN = 1024


def _count(value: Any) -> int | None:
    """An int the way SGLang's pydantic reads one (not a bool); else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _several(prompt: Any) -> int | None:
    """How many prompts a list holds, when it is a batch: strings or token-id lists.

    A list of integers is one prompt in token ids; anything else is left to
    SGLang to refuse (as one request).
    """
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return None


def _parallel_samples(surface: str, body: Body) -> int:
    """``n``: top-level in chat and completions, inside sampling_params for /generate."""
    if surface == SGLANG_GENERATE:
        params = body.get("sampling_params")
        if isinstance(params, list) and params and isinstance(params[0], dict):
            params = params[0]  # SGLang requires the same n in every entry
        n = _count(params.get("n")) if isinstance(params, dict) else None
    elif surface in (CHAT, COMPLETIONS):
        n = _count(body.get("n"))
    else:
        n = None  # Responses and Messages make one completion
    return n if n is not None and n > 1 else 1


def children(surface: str, body: Body) -> int | None:
    """How many requests SGLang makes of this one, when it makes it a batch; else None."""
    prompts = None
    if surface == COMPLETIONS:
        prompts = _several(body.get("prompt"))
    elif surface == SGLANG_GENERATE:
        prompts = _several(body.get("text"))
        ids = body.get("input_ids")
        if prompts is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
            prompts = len(ids)
    n = _parallel_samples(surface, body)
    if prompts is None and n == 1:
        return None
    return (prompts or 1) * n


def too_many_children(surface: str, body: Body) -> tuple[str, str] | None:
    """(param, message) when SGLang would make more than MAX_CHILDREN requests of
    this one; else None."""
    batch = children(surface, body)
    if batch is None or batch <= MAX_CHILDREN:
        return None
    if _parallel_samples(surface, body) > 1:
        param = "sampling_params.n" if surface == SGLANG_GENERATE else "n"
    else:
        param = "prompt" if surface == COMPLETIONS else "text"
    return param, (f"this request makes {batch} sequences (prompts x n); lowproxy pairs at "
                   f"most {MAX_CHILDREN} per request under the sglang handshake")


def needs_decodes_store(surface: str, body: Body) -> tuple[str, str] | None:
    """(param, message) for a Responses request that only the decode's response
    store can serve; else None.

    Under sglang both legs compute the prompt, and a conversation named by
    ``previous_response_id`` (or ``conversation``) is in the store of the decode
    that made it, never the prefill's: SGLang's prefill answers 404, which was a
    502 the SDKs retried. A 400 before either leg says why, once."""
    if surface != RESPONSES:
        return None
    for field in ("previous_response_id", "conversation"):
        if body.get(field):
            return field, (f"`{field}` cannot be served with PD_PROXY_KV_PROTOCOL=sglang: "
                           "both legs compute the prompt, and the prefill server does not "
                           "hold the decode server's stored responses")
    return None


def child_rids(rid: str, batch: int | None) -> tuple[str, ...]:
    """The rids SGLang serves this request under: its own, or ``<rid>_<i>`` per child."""
    if batch is None:
        return (rid,)
    return tuple(f"{rid}_{index}" for index in range(batch))


def rooms_for(batch: int | None, new_room: Callable[[], int]) -> int | list[int]:
    """One room, or one per child (distinct: two children in one room would collide)."""
    if batch is None:
        return new_room()
    rooms: set[int] = set()
    while len(rooms) < batch:
        rooms.add(new_room())
    return sorted(rooms)


def plan(body: Body, target: bytes, path: bytes, prefill: Endpoint, bootstrap_host: str,
         bootstrap_port: int, new_room: Callable[[], int], rid: str,
         surface: str = CHAT) -> Plan:
    """Both legs at once, the same body, the same rooms and the same proxy-made rid.

    ``new_room()`` makes one random room; it is called once per child SGLang
    will make of this request.
    """
    batch = children(surface, body)
    fields = sglang_body(body, bootstrap_host, bootstrap_port, rooms_for(batch, new_room), rid)
    shaped = serialise(fields)
    prefill_body = shaped
    if surface == RESPONSES and not fields.get("background") \
            and fields.get("store", True) is not False:
        # A stored one-token prefill response is kept for ever (SGLang's store has
        # no expiry): the prefill leg says store false, which changes no prompt.
        # Not for background, which SGLang, like vLLM, may refuse without store.
        prefill_body = serialise({**fields, "store": False})
    # No client_body: an SGLang decode cannot recompute the prompt without a
    # bootstrap room (dispatch answers a prefill failure with 502), so there is no
    # fallback to keep the parsed prompt for while both legs run.
    return Plan(b"POST", target, shaped, prefill=prefill,
                prefill_target=path, prefill_body=prefill_body, concurrent=True,
                abort_rids=child_rids(rid, batch),
                merge_input_logprobs=wants_merge(surface, body))
