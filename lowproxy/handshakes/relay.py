"""The relay handshake (GCO proxy, NIXL, vLLM Mooncake 0.13-0.15): prefill, then decode.

Prefill computes the prompt with one token and answers with the
kv_transfer_params decode needs to pull the KV; decode gets them with the flags
turned round. Without them (prefill failed, or returned none) decode computes
the prompt itself, unless PD_PROXY_ON_PREFILL_FAILURE=error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exchange import Exchange, answer_prefill_failed, prefill_leg, send_decode
from ..upstream import Endpoint, UpstreamResponse
from .legs import Body, relay_decode_body, relay_prefill_body, serialise

if TYPE_CHECKING:
    from ..proxy import Proxy


async def run(proxy: "Proxy", exchange: Exchange, body: Body,
              prefill: Endpoint) -> UpstreamResponse | None:
    """Both legs in turn; decode's opened response, or None when the client has its answer."""
    result = await prefill_leg(proxy, exchange, prefill, path_of(exchange),
                               serialise(relay_prefill_body(body)), [], want_kv=True)
    if result.ok:
        decode_body = relay_decode_body(body, result.kv_transfer_params)
    elif proxy.config.on_prefill_failure == "error":
        await answer_prefill_failed(proxy, exchange, result.detail)
        return None
    else:
        proxy.metrics.prefill_legs.inc("relay", "recompute")
        decode_body = body
    return await send_decode(proxy, exchange, b"POST", exchange.request.target,
                             serialise(decode_body))


def path_of(exchange: Exchange) -> bytes:
    """Prefill gets the path without the query string, as the GCO proxy sent it."""
    return exchange.request.target.split(b"?", 1)[0]
