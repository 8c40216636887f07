"""The concurrent handshakes (Mooncake for vLLM 0.16+, SGLang): both legs at once.

Decode cannot produce a token before the KV arrives, so holding decode's
response until prefill has answered 2xx (the commit point) costs nothing and
means the client never sees a response that cannot complete. If prefill fails
or passes its timeout, the held decode connection is closed (vLLM aborts the
request; otherwise it would wait 480 s, or for ever before 0.30), and decode is
asked again without KV (or the client gets 502 with
PD_PROXY_ON_PREFILL_FAILURE=error).

The prefill leg runs in a task of its own: a client that leaves aborts decode
at once, but a prefill leg in flight is left to finish (bounded by the prefill
timeout), since aborting it mid-transfer can leak KV blocks on the prefill side.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..exchange import (Exchange, NoDecodeBackend, answer_decode_failed, answer_no_decode,
                        answer_prefill_failed, decode_timed_out, open_decode, prefill_leg,
                        recompute)
from ..timeouts import deadline
from ..upstream import Endpoint, UpstreamError, UpstreamResponse
from .legs import Body
from .relay import path_of

if TYPE_CHECKING:
    from ..proxy import Proxy


async def run_concurrent(proxy: "Proxy", exchange: Exchange, client_body: Body,
                         prefill: Endpoint, prefill_body: bytes, decode_body: bytes,
                         prefill_headers: list[tuple[bytes, bytes]]
                         ) -> UpstreamResponse | None:
    """Both legs at once; decode's response once prefill has committed, or None.

    None means the client has been answered here (no decode, decode failed,
    prefill failed with PD_PROXY_ON_PREFILL_FAILURE=error, decode timeout).
    """
    prefill_task = proxy.spawn(prefill_leg(proxy, exchange, prefill, path_of(exchange),
                                           prefill_body, prefill_headers, want_kv=False))
    decode_task = proxy.loop.create_task(
        open_decode(proxy, exchange, b"POST", exchange.request.target, decode_body))
    try:
        async with deadline(proxy.config.decode_timeout):
            # Wait for prefill, or for decode to fail first (then answer at once).
            await asyncio.wait((prefill_task, decode_task),
                               return_when=asyncio.FIRST_COMPLETED)
            if not (decode_task.done() and decode_task.exception() is not None):
                result = await asyncio.shield(prefill_task)
                if not result.ok:
                    _drop_decode(decode_task)
                    if proxy.config.on_prefill_failure == "error":
                        await answer_prefill_failed(proxy, exchange, result.detail)
                        return None
                    return await recompute(proxy, exchange, client_body)
            return await decode_task
    except NoDecodeBackend as exc:
        await answer_no_decode(proxy, exchange, str(exc))
    except UpstreamError as exc:
        await answer_decode_failed(proxy, exchange, exc)
    except TimeoutError:
        _drop_decode(decode_task)
        await decode_timed_out(proxy, exchange)
    except BaseException:
        _drop_decode(decode_task)  # the client left: decode aborts at once
        raise
    return None


def _drop_decode(task: "asyncio.Task[UpstreamResponse]") -> None:
    """Close a decode leg that will not be relayed, however far it got."""
    if not task.done():
        task.cancel()  # its connection is discarded: decode sees the drop and aborts
        task.add_done_callback(_close_late)
        return
    _close_late(task)


def _close_late(task: "asyncio.Task[UpstreamResponse]") -> None:
    if task.cancelled() or task.exception() is not None:
        return
    task.result().abandon()
