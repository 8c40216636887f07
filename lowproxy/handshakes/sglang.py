"""SGLang PD: the same body to both legs, plus where and under which room to meet."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from ..exchange import Exchange
from ..upstream import Endpoint, UpstreamResponse
from .concurrent import run_concurrent
from .legs import Body, serialise, sglang_body

if TYPE_CHECKING:
    from ..proxy import Proxy

_rooms = random.SystemRandom()


async def run(proxy: "Proxy", exchange: Exchange, body: Body,
              prefill: Endpoint) -> UpstreamResponse | None:
    port = prefill.spec.bootstrap_port or proxy.config.sglang_bootstrap_port
    room = _rooms.getrandbits(63)  # non-negative, fits SGLang's int64 room id
    shaped = serialise(sglang_body(body, prefill.bootstrap_host, port, room))
    return await run_concurrent(proxy, exchange, body, prefill, shaped, shaped, [])
