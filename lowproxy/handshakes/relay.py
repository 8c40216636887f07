"""The relay handshake (GCO proxy, NIXL, vLLM Mooncake 0.13-0.15): prefill, then decode.

Prefill computes the prompt with one token and answers with the
kv_transfer_params decode needs to pull the KV; decode gets them with the flags
turned round. Without them (prefill failed, or returned none) decode computes
the prompt itself, unless PD_PROXY_ON_PREFILL_FAILURE=error.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from .._types import Body
from ..routes import CHAT
from ..upstream.endpoint import Endpoint
from .legs import Plan, relay_decode_body, relay_prefill_body, serialise


def plan(body: Body, target: bytes, path: bytes, prefill: Endpoint, surface: str = CHAT,
         forward_token_ids: bool = False,
         serialise_leg: Callable[[Body], bytes] = serialise) -> Plan:
    """Both legs in turn: decode's body is made from prefill's answer.

    ``forward_token_ids`` (PD_PROXY_FORWARD_PROMPT_TOKEN_IDS, chat only): the
    prefill leg asks for the prompt's token ids and decode gets them in its
    kv_transfer_params, so it skips its own tokenization (vLLM 0.31+).
    ``serialise_leg`` writes both legs (legs.leg_serialiser: the prompt encoded once).
    """
    prefill_body = relay_prefill_body(body, surface)
    if forward_token_ids and surface == CHAT:
        prefill_body["return_token_ids"] = True
    return Plan(b"POST", target, None, client_body=body, prefill=prefill,
                prefill_target=path, prefill_body=serialise_leg(prefill_body),
                decode_body_for=partial(_decode_body, body, serialise_leg))


def _decode_body(body: Body, serialise_leg: Callable[[Body], bytes], prefill_kv: Any,
                 prompt_token_ids: Any = None) -> bytes:
    return serialise_leg(relay_decode_body(body, prefill_kv, prompt_token_ids))
