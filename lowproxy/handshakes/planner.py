"""From a generation request to its Plan: decode only, or which handshake's two legs.

Everything that decides *what* is sent lives in the handshakes' plan()
functions and legs.py, which are pure; this module picks one, and makes the
random parts (Mooncake's transfer id, SGLang's room) and awaits the one input
that needs I/O (Mooncake's bootstrap map), so that the plans stay pure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol

from .._types import Body
from ..config.settings import Config
from ..ids import Ids
from ..upstream.endpoint import Endpoint
from . import mooncake, relay, sglang
from .bootstrap import BootstrapCache, BootstrapError
from .legs import Plan, decode_only_plan, leg_serialiser, serialise
from .request_models import refused_field
from .rules import SHORT, cannot_hand_off, decode_would_reject, too_short

DECODE_CACHED = "decode-cached"  # decode-first: decode holds all but a few tokens

_rooms = random.SystemRandom()


@dataclass(slots=True)
class Generation:
    """A generation request as the planner reads it: the client's body parsed once."""

    surface: str  # routes.CHAT, COMPLETIONS, ...
    target: bytes  # path and query as the client sent them: decode's target
    path: bytes  # the path alone: prefill's target, as the GCO proxy sent it
    body: Body
    prompt_bytes: int | None = None  # the prompt's size, when a setting reads it
    decode_cached: bool = False  # decode-first: decode holds all but a few of its tokens
    body_bytes: int = 0  # the client's body as it came: how its legs are best serialised


class PrefillPick(Protocol):
    """Routing's prefill choice, asked for only when a prefill leg is planned."""

    @property
    def configured(self) -> bool: ...

    def __call__(self) -> Endpoint | None: ...


def _new_room() -> int:
    return _rooms.getrandbits(sglang.ROOM_BITS)  # non-negative, fits SGLang's int64 room


def _refused_under_sglang(body: Body, surface: str) -> tuple[str, str] | None:
    return sglang.too_many_children(surface, body) or sglang.needs_decodes_store(surface, body)


def _refused_by_vllm(body: Body, surface: str) -> tuple[str, str] | None:
    return refused_field(body, surface) or decode_would_reject(body, surface)


def refusal_rules(kv_protocol: str) -> Callable[[Body, str], tuple[str, str] | None]:
    """What answers a request 400 before either leg, as (param, message) or None.

    vLLM's handshakes: one decode rejects in its request model though its
    shaped prefill leg is accepted (decode_would_reject), or a value vLLM's
    request model refuses in a field the prefill leg cleans off
    (request_models.refused_field): that KV would stay pinned. Under sglang both
    legs get the one body, so what SGLang rejects both reject, and vLLM's rules
    would only refuse what SGLang accepts (stream_options without stream, say);
    there the rules are one SGLang would make into more requests than lowproxy
    pairs (sglang.too_many_children) and a conversation only decode's store
    holds (sglang.needs_decodes_store). Chosen once per handshake, so that no
    handshake pays for another's rules."""
    return _refused_under_sglang if kv_protocol == "sglang" else _refused_by_vllm


def skip_reason(config: Config, surface: str, body: Body, prompt_bytes: int | None
                ) -> str | None:
    """Why this request goes to decode alone although prefill is configured; else None.

    Never under sglang: an SGLang decode in disaggregation mode refuses every
    request without a bootstrap room, so vLLM's decode-only rules (and the
    short-prompt one) would only turn requests into decode's 400.
    """
    if config.kv_protocol == "sglang":
        return None
    skipped = cannot_hand_off(surface, body)
    if skipped is None and too_short(prompt_bytes, config.min_prefill_prompt_bytes):
        skipped = SHORT
    return skipped


async def plan_generation(config: Config, bootstrap: BootstrapCache, ids: Ids,
                          request: Generation, choose_prefill: PrefillPick) -> Plan:
    """The plan for one generation request; ``choose_prefill()`` names its prefill endpoint.

    The prefill endpoint is chosen only for a request that will have a prefill
    leg, so a skipped request counts no prefill choice and no prefill load.
    """
    surface, target, body = request.surface, request.target, request.body
    if not choose_prefill.configured:
        # No prefill configured: decode computes the prompt itself, no handshake.
        return decode_only_plan(b"POST", target, serialise(body))
    skipped = skip_reason(config, surface, body, request.prompt_bytes)
    if skipped is None and request.decode_cached and config.kv_protocol != "sglang":
        # SGLang's decode cannot run without a bootstrap_room: never skipped there.
        skipped = DECODE_CACHED
    if skipped is not None:
        # Decode gets the client's request unchanged and computes the prompt.
        return decode_only_plan(b"POST", target, serialise(body), skip_reason=skipped)
    prefill = choose_prefill()
    if prefill is None:  # dns+ names that resolve to no address
        return decode_only_plan(b"POST", target, None, client_body=body,
                                prefill_failure="no usable prefill endpoint")
    return await _two_legs(config, bootstrap, ids, request, prefill)


async def _two_legs(config: Config, bootstrap: BootstrapCache, ids: Ids, request: Generation,
                    prefill: Endpoint) -> Plan:
    """The configured handshake's plan, with its prefill leg going to ``prefill``."""
    handshake = config.kv_protocol
    surface, target, path, body = request.surface, request.target, request.path, request.body
    serialise_leg = leg_serialiser(body, request.body_bytes)
    if handshake == "relay":
        return relay.plan(body, target, path, prefill, surface, config.forward_prompt_token_ids,
                          serialise_leg)
    if handshake == "sglang":
        port = prefill.spec.bootstrap_port or config.sglang_bootstrap_port
        rid = f"lowproxy-{ids.next_hex()}"  # fixed width: no rid is a prefix of another
        return sglang.plan(body, target, path, prefill, prefill.bootstrap_host, port,
                           _new_room, rid, surface)
    engines = bootstrap.cached(prefill)
    if engines is None:
        try:
            engines = await bootstrap.engines(prefill)
        except BootstrapError as exc:
            failed = decode_only_plan(b"POST", target, None, client_body=body,
                                      prefill_failure=str(exc))
            failed.prefill = prefill
            return failed
    rank, engine_id = engines.next_rank()
    # xfer-<uuid4>: the llm-d sidecar's form, kept so logs and tools line up.
    return mooncake.plan(body, target, path, prefill, rank, engine_id, engines.bootstrap_addr,
                         f"xfer-{ids.next_uuid()}", surface, serialise_leg)
