"""The Mooncake bootstrap handshake of vLLM 0.16+ (as the llm-d sidecar speaks it).

Prefill returns nothing useful any more; instead both legs share a fresh
transfer id, and decode is told which engine (of which data-parallel rank) to
pull from and where that prefill's bootstrap server listens. The engine map
comes from the prefill's bootstrap server (bootstrap.py), awaited before
planning.
"""

from __future__ import annotations

import functools
from typing import Callable

from .._types import KV, Body
from ..routes import CHAT
from ..upstream.endpoint import Endpoint
from .legs import Plan, mooncake_bodies, serialise

RANK_HEADER = b"X-data-parallel-rank"
# How decode's kv_transfer_params member starts: after the client's members, or alone.
_KV_AFTER = b',"%s":{' % KV.encode("ascii")
_KV_ALONE = b'{"%s":{' % KV.encode("ascii")


def plan(body: Body, target: bytes, path: bytes, prefill: Endpoint, rank: str, engine_id: str,
         bootstrap_addr: str, transfer_id: str, surface: str = CHAT,
         serialise_leg: Callable[[Body], bytes] = serialise) -> Plan:
    """Both legs at once; the prefill leg lands on ``rank``, whose engine decode pulls from.

    ``serialise_leg`` writes both legs (legs.leg_serialiser: the prompt encoded once)."""
    prefill_body, decode_body = mooncake_bodies(body, transfer_id, engine_id, bootstrap_addr,
                                                surface)
    decode = serialise_leg(decode_body)
    # The recompute fallback (the client's body) is cut from decode's bytes, so that
    # no parsed prompt is kept while both legs run (a connect storm keeps thousands
    # running at once, and that peak is what the process's memory keeps).
    fallback = client_body_in(decode)
    return Plan(b"POST", target, decode, client_body=body if fallback is None else None,
                prefill=prefill, prefill_target=path,
                prefill_body=serialise_leg(prefill_body),
                prefill_headers=[(RANK_HEADER, rank.encode())], concurrent=True,
                fallback=fallback)


def client_body_in(decode: bytes) -> Callable[[], bytes] | None:
    """What gives the client's body, as serialise writes it, from decode's bytes: those
    before its kv_transfer_params member, closed (pure).

    mooncake_bodies adds that member last, and the client's own was dropped on
    arrival, so the last ``,"kv_transfer_params":{`` is it: inside an encoded
    string every quote is escaped, and the member's value (flat, ASCII) names no
    such key. None when the bytes are not of that shape (the caller keeps the body).
    """
    if not decode.endswith(b"}}"):
        return None
    cut = decode.rfind(_KV_AFTER)
    if cut > 0:
        return functools.partial(_closed_before, decode, cut)
    if decode.startswith(_KV_ALONE):
        return _empty_object
    return None


def _closed_before(encoded: bytes, cut: int) -> bytes:
    return encoded[:cut] + b"}"


def _empty_object() -> bytes:
    return b"{}"
