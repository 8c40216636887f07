"""--workers with cache-aware routing: the workers of one daemon share their prefill choices.

Each worker (workers.py) is a process of its own with its own CacheRouter, and
a request reaches whichever worker accepted its connection: like replicas
taking turns, each worker would know only what it sent where, and a
conversation's turns would split between prefills (bench/load_replay.py: two
replicas that share nothing lose 9 to 13 points of hit rate in few-shot and
mix). So every prefill choice a worker makes is told to its siblings, as
PD_PROXY_PEERS does between replicas (peers.py), but through the host itself:
each worker binds a Unix datagram socket ``choices-<index>.sock`` in the
daemon's private directory (the one its metrics are shared through, made by
the parent before forking, mode 0700), and FLUSH_SECONDS after the first
choice not yet told, one datagram per MAX_DATAGRAM_KEYS keys (peer_batch.py's
encoding) goes to every sibling's socket. A datagram that cannot go (the
sibling is restarting, its buffer is full) is dropped and counted, never
queued: a later choice tells the same prefix again.

The block keys need not be the stable ones peers need: the workers are forked
from one parent, so they share Python's hash secret; a batch carries the
sender's probe key and one computed otherwise is ignored (and said once).
Choices a worker learns from its siblings or from peers are not passed on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, Sequence

from .blocks import chain_of, hash_probe
from .cache_router import CacheRouter
from .groups import BackendGroup
from .peer_batch import BatchError, decode, encode

log = logging.getLogger("lowproxy.workers")

FLUSH_SECONDS = 0.02
MAX_DATAGRAM_KEYS = 8192  # 64 KiB of keys a datagram, well under a Unix socket's buffer
MAX_OUTBOX_KEYS = 1 << 16  # what waits for a flush; more is dropped (and counted)
MAX_DATAGRAM_BYTES = 1 << 20


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"choices-{index}.sock")


def probe_key(block_bytes: int, stable: bool) -> int:
    """The last key of a fixed text, as this process keys blocks: equal in two
    workers only when their keys are."""
    if stable:
        return hash_probe(block_bytes)
    return chain_of(b"lowproxy" * (2 * block_bytes // 8 + 1), block_bytes)[-1]


class WorkerShare:
    """This worker's datagram socket, what it has noted since the last flush, and its
    siblings' sockets."""

    def __init__(self, directory: str, index: int, workers: int, router: CacheRouter,
                 prefill: BackendGroup, metrics: Any) -> None:
        self.router = router
        self.prefill = prefill
        self.index = index
        self.siblings = [socket_path(directory, other) for other in range(workers)
                         if other != index]
        self.block_bytes = router.block_bytes
        self.probe = probe_key(self.block_bytes, router.stable)
        metrics.worker_share_on = True
        self.sent = metrics.worker_records_sent
        self.dropped = metrics.worker_records_dropped
        self.received = metrics.worker_records_received
        path = socket_path(directory, index)
        try:
            os.unlink(path)  # the last worker of this index, restarted
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)
        self.outbox: list[tuple[str, Sequence[int]]] = []
        self.keys = 0
        self.lost = 0
        self.mismatch_said = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        told = router.shared  # PD_PROXY_PEERS may be told too
        router.shared = self.note if told is None else self._both(told)

    def _both(self, told: Any) -> Any:
        def note(label: str, chain: list[int]) -> None:
            told(label, chain)
            self.note(label, chain)
        return note

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            self._loop = None
        path = self.sock.getsockname()
        self.sock.close()
        try:
            os.unlink(path)
        except OSError:  # the parent removed the directory already
            pass

    # -- sending

    def note(self, label: str, chain: list[int]) -> None:
        """A prefill choice made here (CacheRouter._count_choice): told at the next flush."""
        if self.keys + len(chain) > MAX_OUTBOX_KEYS:
            self.lost += 1
            return
        self.outbox.append((label, chain))
        self.keys += len(chain)
        if self._flush_timer is None and self._loop is not None:
            self._flush_timer = self._loop.call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        """One datagram per MAX_DATAGRAM_KEYS keys noted, to every sibling."""
        self._flush_timer = None
        records, lost = self.outbox, self.lost
        self.outbox, self.keys, self.lost = [], 0, 0
        if lost:
            self.dropped.inc(amount=lost * len(self.siblings))
        for part in _parts(records):
            datagram = encode(self.index, self.probe, self.block_bytes, part)
            for sibling in self.siblings:
                try:
                    self.sock.sendto(datagram, sibling)
                except OSError:  # restarting (no socket yet), or its buffer is full
                    self.dropped.inc(amount=len(part))
                else:
                    self.sent.inc(amount=len(part))

    # -- receiving

    def _readable(self) -> None:
        for _ in range(64):  # at most this many a wake-up: requests come first
            try:
                datagram = self.sock.recv(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # pragma: no cover - a datagram socket has no peer to lose
                log.warning("reading sibling workers' choices failed: %s", exc)
                return
            self.receive(datagram)

    def receive(self, datagram: bytes) -> int:
        """Record a sibling's batch in this worker's prefill index; how many were."""
        try:
            batch = decode(datagram)
        except BatchError as exc:
            log.warning("a datagram on %s is not a batch of choices: %s",
                        self.sock.getsockname(), exc)
            return 0
        if batch.probe != self.probe or batch.block_bytes != self.block_bytes:
            if not self.mismatch_said:
                self.mismatch_said = True
                log.warning("worker %d keys prompt blocks otherwise than worker %d: its "
                            "prefill choices are ignored", batch.replica, self.index)
            return 0
        recorded = self.router.record_told(
            batch.records, {endpoint.label for endpoint in self.prefill.endpoints})
        self.received.inc(amount=recorded)
        return recorded


def _parts(records: list[tuple[str, Sequence[int]]]) -> list[list[tuple[str, Sequence[int]]]]:
    parts: list[list[tuple[str, Sequence[int]]]] = []
    keys = MAX_DATAGRAM_KEYS
    for record in records:
        if keys + len(record[1]) > MAX_DATAGRAM_KEYS:
            parts.append([])
            keys = 0
        parts[-1].append(record)
        keys += len(record[1])
    return parts


__all__ = ["WorkerShare", "socket_path"]
