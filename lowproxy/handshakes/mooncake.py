"""The Mooncake bootstrap handshake of vLLM 0.16+ (as the llm-d sidecar speaks it).

Prefill returns nothing useful any more; instead both legs share a fresh
transfer id, and decode is told which engine (of which data-parallel rank) to
pull from and where that prefill's bootstrap server listens.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from .. import logs
from ..exchange import Exchange, answer_prefill_failed, log, recompute
from ..upstream import Endpoint, UpstreamResponse
from .bootstrap import BootstrapError
from .concurrent import run_concurrent
from .legs import Body, mooncake_bodies, serialise

if TYPE_CHECKING:
    from ..proxy import Proxy

RANK_HEADER = b"X-data-parallel-rank"


async def run(proxy: "Proxy", exchange: Exchange, body: Body,
              prefill: Endpoint) -> UpstreamResponse | None:
    try:
        engines = await proxy.bootstrap.engines(prefill)
    except BootstrapError as exc:
        proxy.metrics.prefill_legs.inc("mooncake", "error")
        logs.warn(log, f"mooncake bootstrap query failed: {exc}", exchange.request_id,
                  backend=prefill.label)
        if proxy.config.on_prefill_failure == "error":
            await answer_prefill_failed(proxy, exchange, str(exc))
            return None
        return await recompute(proxy, exchange, body)
    rank, engine_id = engines.next_rank()
    transfer_id = f"xfer-{uuid.uuid4()}"
    prefill_body, decode_body = mooncake_bodies(body, transfer_id, engine_id,
                                                proxy.bootstrap.bootstrap_addr(prefill))
    return await run_concurrent(proxy, exchange, body, prefill, serialise(prefill_body),
                                serialise(decode_body), [(RANK_HEADER, rank.encode())])
