"""SGLang's aborts: no leg waits out SGLANG_DISAGGREGATION_WAITING_TIMEOUT.

An SGLang leg whose other leg failed, or whose client left, would wait for its
peer up to 300 s: it is aborted by the rids the plan gave it (``POST
/abort_request``, auxiliary_legs.send_abort, in the background). Under vLLM's
handshakes a plan has no rids and nothing here sends anything: a prefill leg
whose KV nobody will read is only closed (close_prefill).
"""

from __future__ import annotations

import asyncio
import logging

from ..handshakes.legs import Plan
from ..observability import logs
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Upstream, UpstreamResponse
from .auxiliary_legs import BackgroundTasks, send_abort
from .exchange import Exchange
from .failures import PrefillResult

log = logging.getLogger("lowproxy.dispatch")


class LegAborts:
    """Sends a request's aborts, with the key SGLang takes there."""

    __slots__ = ("upstream", "background", "authorization")

    def __init__(self, upstream: Upstream, background: BackgroundTasks, admin_key: str) -> None:
        self.upstream = upstream
        self.background = background
        # SGLang's --admin-api-key (PD_PROXY_SGLANG_ADMIN_API_KEY): once set, the only
        # key /abort_request takes; else the legs' own authorization.
        self.authorization = [(b"authorization", b"Bearer " + admin_key.encode())] \
            if admin_key else None

    def abort(self, exchange: Exchange, endpoint: Endpoint, role: str,
              rids: tuple[str, ...]) -> None:
        """Ask ``endpoint`` to abort this request's leg by the plan's rids (SGLang only)."""
        if not rids:
            return
        if role == "decode":
            exchange.decode_endpoint = None  # once per leg
        self.background.spawn(send_abort(self.upstream, endpoint, rids, role,
                                         exchange.request_id, self.authorization
                                         or exchange.upstream_headers))

    def drop_decode(self, exchange: Exchange, response: UpstreamResponse | None,
                    abort_rids: tuple[str, ...]) -> None:
        """Close a decode leg that will not be relayed, and abort it by rid (SGLang).

        A leg whose head had not come is closed already: the cancelled or
        failed wait discarded its connection."""
        if response is not None:
            response.abandon()
        if exchange.decode_endpoint is not None:
            self.abort(exchange, exchange.decode_endpoint, "decode", abort_rids)

    async def close_prefill(self, exchange: Exchange, plan: Plan,
                            prefill_task: asyncio.Task[PrefillResult],
                            never_read: bool = False) -> bool:
        """Decode failed first: SGLang's prefill leg (which would wait for that
        decode up to SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s) is aborted by
        rid and closed. A vLLM one is closed when ``never_read``: no decode got
        the request (every one refused the connection) or decode gave its final
        answer (an error status), so nothing will ever pull that KV, and vLLM,
        seeing its client gone, aborts the request and frees its blocks, where a
        Mooncake prefill that finished would hold them for a pull that never
        comes (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s). Otherwise it is left
        to finish, as aborting it mid-transfer can leak KV blocks.

        Two loop iterations first: decode's failure reaches this point as it
        did when decode ran in a task of its own (through its done callback and
        a wake-up), so a prefill leg whose connection was being made is sent,
        then aborted, as before; never on the path of a request that succeeds.
        """
        if plan.prefill is None or not (plan.abort_rids or never_read):
            return False
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        if prefill_task.done():
            return False
        if not plan.abort_rids:
            logs.warn(log, "prefill leg closed: no decode will read its KV (decode failed "
                      "first), so the engine frees it", exchange.request_id,
                      backend=plan.prefill.label, handshake=exchange.handshake)
        self.abort(exchange, plan.prefill, "prefill", plan.abort_rids)  # SGLang's rids
        prefill_task.cancel()  # its connection is discarded: vLLM and SGLang notice
        return True


__all__ = ["LegAborts"]
