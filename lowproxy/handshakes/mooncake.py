"""The Mooncake bootstrap handshake of vLLM 0.16+ (as the llm-d sidecar speaks it).

Prefill returns nothing useful any more; instead both legs share a fresh
transfer id, and decode is told which engine (of which data-parallel rank) to
pull from and where that prefill's bootstrap server listens. The engine map
comes from the prefill's bootstrap server (bootstrap.py), awaited before
planning.
"""

from __future__ import annotations

from typing import Callable

from .._types import Body
from ..routes import CHAT
from ..upstream.endpoint import Endpoint
from .legs import Plan, mooncake_bodies, serialise

RANK_HEADER = b"X-data-parallel-rank"


def plan(body: Body, target: bytes, path: bytes, prefill: Endpoint, rank: str, engine_id: str,
         bootstrap_addr: str, transfer_id: str, surface: str = CHAT,
         serialise_leg: Callable[[Body], bytes] = serialise) -> Plan:
    """Both legs at once; the prefill leg lands on ``rank``, whose engine decode pulls from.

    ``serialise_leg`` writes both legs (legs.leg_serialiser: the prompt encoded once)."""
    prefill_body, decode_body = mooncake_bodies(body, transfer_id, engine_id, bootstrap_addr,
                                                surface)
    return Plan(b"POST", target, serialise_leg(decode_body), client_body=body,
                prefill=prefill, prefill_target=path,
                prefill_body=serialise_leg(prefill_body),
                prefill_headers=[(RANK_HEADER, rank.encode())], concurrent=True)
