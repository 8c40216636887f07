"""Prefill choices shared between proxy replicas (PD_PROXY_PEERS), so each follows all legs.

Each replica's CacheRouter remembers what it sent to which prefill; two
replicas taking turns each know half, and split a conversation's cache
between endpoints (bench/load_replay.py --share-index shows what one shared
index recovers). With peers set, every prefill choice (the endpoint's label
and the prompt's chain of block keys, as CacheRouter._count_choice records
them) is told to every peer: gathered for FLUSH_SECONDS from the first one
(no choice, no wake-up), at most MAX_RECORDS records and MAX_KEYS keys a
batch (the rest is dropped and counted), then POSTed once to each peer over
lowproxy's pooled upstream client (peer_batch.py's binary body). A peer
still busy with the last batch, or failed within RETRY_SECONDS, is skipped
for this one: batches are dropped, never queued. One warning names a peer
when it becomes unreachable, one when it answers again.

A receiving replica records each chain in its own prefill index for the
labels it knows, as if it had sent it (not in its queued work: the sender's
engine reports that), and ignores its own batches (a dns+ name may resolve
to itself: the batch carries a random id per process). Labels are the
configured backend URLs (lowercased, no trailing slash) or, for dns+ names,
the resolved addresses: replicas configured alike compare alike.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any, Iterable, Sequence

from .. import answers
from ..observability.metrics import Metrics
from ..timeouts import deadline
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Resolver, Upstream, UpstreamError, UpstreamTimeout
from .blocks import hash_probe
from .cache_router import CacheRouter
from .groups import BackendGroup
from .peer_batch import BatchError, decode, encode

log = logging.getLogger("lowproxy.peers")

PEERS_PATH = "/lowproxy/peers/choices"
FLUSH_SECONDS = 0.02
MAX_RECORDS = 2048  # a batch: 100k choices a second per replica at 20 ms
MAX_KEYS = 1 << 16  # 512 KiB of keys
MAX_BODY_BYTES = 1 << 20  # what a receiver reads; a sender's batch is below it
SEND_SECONDS = 2.0
RETRY_SECONDS = 1.0  # a peer that failed is not sent to again before this
MAX_ANSWER_BYTES = 64 * 1024
CONTENT_TYPE = (b"content-type", b"application/x-lowproxy-choices")
OWN_ANSWER = b'{"status":"own"}'  # the batch came back to the replica that sent it


class PeerMetrics:
    """The counters of the Proxy's Metrics this module counts in, exported from now on."""

    def __init__(self, metrics: Metrics) -> None:
        metrics.peers_on = True
        self.batches_sent = metrics.peer_batches_sent
        self.records_sent = metrics.peer_records_sent
        self.dropped = metrics.peer_records_dropped
        self.failures = metrics.peer_send_failures
        self.batches_received = metrics.peer_batches_received
        self.records_received = metrics.peer_records_received


class PeerShare:
    def __init__(self, config: Any, upstream: Upstream, router: CacheRouter,
                 prefill: BackendGroup, metrics: Metrics) -> None:
        self.upstream = upstream
        self.router = router
        self.prefill = prefill
        self.metrics = PeerMetrics(metrics)
        self.group = BackendGroup("peer", config.peers)
        self.replica = int.from_bytes(os.urandom(8), "little")
        self.block_bytes = config.prefix_block_bytes
        self.probe = hash_probe(self.block_bytes)
        self.headers = [CONTENT_TYPE]
        if config.admin_api_key:  # the receiver requires it when it has one
            self.headers.append((b"x-admin-api-key", config.admin_api_key.encode()))
        self.outbox: list[tuple[str, Sequence[int]]] = []
        self.keys = 0
        self.lost = 0  # records dropped at the bound since the last flush
        self.sending: dict[Endpoint, asyncio.Task[None]] = {}
        self.retry_at: dict[Endpoint, float] = {}
        self.down: set[Endpoint] = set()  # warned about: unreachable or refusing
        self.own: set[Endpoint] = set()  # this replica itself (a dns+ name): skipped
        self._sequence = 0
        self._known: tuple[list[Endpoint] | None, set[str]] = (None, set())
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._flush_timer: asyncio.TimerHandle | None = None  # armed by the first note
        router.shared = self.note
        metrics.peer_up.read = self.up

    # -- sending

    def note(self, label: str, chain: list[int]) -> None:
        """A prefill choice made here (CacheRouter._count_choice): told at the next flush."""
        if len(self.outbox) >= MAX_RECORDS or self.keys + len(chain) > MAX_KEYS:
            self.lost += 1
            return
        self.outbox.append((label, chain))  # at most 16384 keys (blocks.py): no copy
        self.keys += len(chain)
        # The first choice since a flush arms the next one: no choice, no wake-up.
        if self._flush_timer is None and self._loop is not None:
            self._flush_timer = self._loop.call_later(FLUSH_SECONDS, self._flush_due)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def refresh(self, resolver: Resolver) -> None:
        """Resolve the dns+ peers again; forget what was known of peers gone."""
        await self.group.refresh(resolver, self.upstream)
        present = set(self.group.endpoints)
        self.down &= present
        self.own &= present
        for gone in [endpoint for endpoint in self.retry_at if endpoint not in present]:
            del self.retry_at[gone]

    def _flush_due(self) -> None:
        self._flush_timer = None
        try:
            self.flush()
        except Exception:  # pragma: no cover - a bug must not end the sharing
            log.exception("telling the peers failed")

    def flush(self) -> None:
        """Send what was noted since the last flush to every peer ready for it."""
        records, lost = self.outbox, self.lost
        if not records and not lost:
            return
        self.outbox, self.keys, self.lost = [], 0, 0
        now, ready, dropped = time.monotonic(), [], self.metrics.dropped
        for endpoint in self.group.endpoints:
            if endpoint in self.own:
                continue
            if lost:
                dropped.inc(endpoint.label, amount=lost)
            if endpoint in self.sending or now < self.retry_at.get(endpoint, 0.0):
                dropped.inc(endpoint.label, amount=len(records))  # busy, or failed just now
            elif records:
                ready.append(endpoint)
        if not ready:
            return
        body = encode(self.replica, self.probe, self.block_bytes, records)
        loop = asyncio.get_running_loop()
        for endpoint in ready:
            task = loop.create_task(self._send(endpoint, body, len(records)))
            self.sending[endpoint] = task
            task.add_done_callback(functools.partial(self._sent, endpoint))

    def _sent(self, endpoint: Endpoint, task: asyncio.Task[None]) -> None:
        if self.sending.get(endpoint) is task:
            del self.sending[endpoint]
        if not task.cancelled() and task.exception() is not None:  # a bug: said, not lost
            log.error("sending to peer %s failed", endpoint.label, exc_info=task.exception())

    async def _send(self, endpoint: Endpoint, body: bytes, count: int) -> None:
        self._sequence += 1
        # Recording a batch twice does no harm: the pool may send it again on a fresh
        # connection when a reused one was closed under it.
        headers = [*self.headers,
                   (b"idempotency-key", b"%016x-%d" % (self.replica, self._sequence))]
        try:
            async with deadline(SEND_SECONDS):
                response = await self.upstream.request(endpoint, b"POST",
                                                       PEERS_PATH.encode(), headers, body)
                try:
                    raw = await response.read(MAX_ANSWER_BYTES)
                finally:
                    await response.aclose()
        except TimeoutError:
            self._failed(endpoint, "timeout", f"no answer within {SEND_SECONDS:g}s", count)
            return
        except UpstreamError as exc:
            kind = "timeout" if isinstance(exc, UpstreamTimeout) else "unreachable"
            self._failed(endpoint, kind, exc.detail, count)
            return
        if not 200 <= response.status < 300:
            self._failed(endpoint, "refused", f"answered {response.status}: "
                         f"{raw[:200].decode('utf-8', 'replace')}", count)
            return
        if raw == OWN_ANSWER:
            self.own.add(endpoint)
            log.info("peer %s is this replica itself: prefill choices are not sent to it",
                     endpoint.label)
            return
        self.metrics.batches_sent.inc(endpoint.label)
        self.metrics.records_sent.inc(endpoint.label, amount=count)
        self.retry_at.pop(endpoint, None)
        if endpoint in self.down:
            self.down.discard(endpoint)
            log.warning("peer %s answers again: prefill choices are shared with it",
                        endpoint.label)

    def _failed(self, endpoint: Endpoint, kind: str, why: str, count: int) -> None:
        self.metrics.failures.inc(endpoint.label, kind)
        self.metrics.dropped.inc(endpoint.label, amount=count)
        self.retry_at[endpoint] = time.monotonic() + RETRY_SECONDS
        if endpoint not in self.down:
            self.down.add(endpoint)
            if kind == "refused" and "403" in why[:13]:
                why += " (ADMIN_API_KEY differs between the replicas?)"
            log.warning("peer %s unreachable (%s): prefill choices are not shared with it "
                        "until it answers", endpoint.label, why)

    async def close(self) -> None:
        self._loop = None  # nothing is armed again
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        pending = list(self.sending.values())
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for endpoint in self.group.endpoints:
            self.upstream.close_idle(endpoint)

    def endpoints(self) -> Iterable[Endpoint]:
        yield from self.group.endpoints
        yield from self.group.retired

    def up(self) -> Iterable[tuple[tuple[str, ...], float]]:
        """lowproxy_peer_up{peer}: 0 for a peer whose last batch failed."""
        for endpoint in self.group.endpoints:
            if endpoint not in self.own:
                yield (endpoint.label,), 0.0 if endpoint in self.down else 1.0

    # -- receiving

    def receive(self, raw: bytes) -> tuple[int, bytes]:
        """A peer's batch (the admin key, when one is set, was checked): (status, body)."""
        received = self.metrics.batches_received
        if len(raw) > MAX_BODY_BYTES:
            received.inc("refused")
            return 413, answers.error_body(
                413, f"a batch is at most {MAX_BODY_BYTES} bytes", "invalid_request")
        try:
            batch = decode(raw)
        except BatchError as exc:
            received.inc("refused")
            return 400, answers.error_body(400, str(exc), "invalid_request")
        if batch.replica == self.replica:
            received.inc("own")
            return 200, OWN_ANSWER
        if batch.block_bytes != self.block_bytes or batch.probe != self.probe:
            received.inc("refused")
            return 409, answers.error_body(
                409, "this replica keys prompt blocks otherwise (PD_PROXY_PREFIX_BLOCK_BYTES "
                f"{self.block_bytes}, or another Python build)", "peer_mismatch")
        recorded = self.router.record_told(batch.records, self._labels())
        received.inc("recorded")
        self.metrics.records_received.inc("recorded", amount=recorded)
        if recorded < len(batch.records):
            self.metrics.records_received.inc("unknown", amount=len(batch.records) - recorded)
        return 200, answers.json_body({"status": "ok", "recorded": recorded})

    def _labels(self) -> set[str]:
        """The labels of the prefills configured here (a label we do not know is ignored)."""
        endpoints = self.prefill.endpoints
        if self._known[0] is not endpoints:
            self._known = (endpoints, {endpoint.label for endpoint in endpoints})
        return self._known[1]


__all__ = ["MAX_BODY_BYTES", "PEERS_PATH", "PeerShare"]
