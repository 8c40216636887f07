"""--workers with cache-aware routing: the workers of one daemon tell each other their
prefill choices over Unix datagram sockets (routing/worker_share.py). Two proxies in this
process stand for two workers: the same turns that split between prefills when each
knows only its own legs stay on one prefill after a spill when they share; a datagram
keyed otherwise is ignored, a sibling that is not there costs a counted drop, a big
flush goes in several datagrams; and a real --workers daemon counts what its workers
told each other."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, AsyncIterator

import pytest

from helpers import Daemon, config_for, free_port, pd_backends, request, wait_until
from helpers.conversation import CHAT, legs_at, turns
from lowproxy.daemon import limits_of
from lowproxy.downstream import HttpServer
from lowproxy.proxy import Proxy
from lowproxy.routing.peer_batch import decode, encode
from lowproxy.routing.worker_share import MAX_DATAGRAM_KEYS, WorkerShare, socket_path


@contextlib.asynccontextmanager
async def worker(config: Any, directory: str | None, index: int) -> AsyncIterator[Proxy]:
    """A proxy in this process standing for worker ``index`` of a --workers daemon
    (``directory``: the daemon's private one; None: the worker shares nothing)."""
    proxy = Proxy(config)
    if directory is not None:
        proxy.share_with_workers(directory, index)
    await proxy.start()
    server = HttpServer(proxy.handle, limits_of(config))
    await server.listen("127.0.0.1", config.port)
    try:
        yield proxy
    finally:
        await server.drain(0)
        await proxy.close()


def received(proxy: Proxy) -> float:
    return proxy.metrics.worker_records_received.get()


@pytest.mark.parametrize("shared", [True, False])
async def test_turns_taken_by_either_worker_stay_on_one_prefill_after_a_spill(shared, tmp_path):
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        configs = [config_for([b.url for b in pre], [b.url for b in dec],
                              prefill_policy="cache-aware", workers=2, port=free_port())
                   for _ in range(2)]
        directory = str(tmp_path) if shared else None
        async with worker(configs[0], directory, 0) as a, worker(configs[1], directory, 1) as b:
            assert (a.worker_share is not None) == shared
            said = ["first question " * 20]

            async def turn(proxy: Proxy, config: Any) -> int:
                """One turn through ``proxy``: the prefill that took it (0 or 1)."""
                before = [legs_at(p) for p in pre]
                other = b if proxy is a else a
                seen = received(other)
                reply = await request(config.port, "POST", CHAT, turns(*said))
                assert reply.status == 200, reply.body
                said.append(f"question {len(said)} " * 20)
                took = [legs_at(p) - n for p, n in zip(pre, before, strict=True)].index(1)
                if shared:  # the sibling has heard of this leg before the next turn
                    await wait_until(lambda: received(other) > seen, what="the datagram")
                return took

            home = await turn(b, configs[1])  # cold: the rendezvous order's first
            # A believes home swamped (as when its own legs queue there): its next turn
            # spills to the other prefill, which then holds the conversation's latest turn.
            assert a.router is not None
            a.router.queued[a.prefill.endpoints[home]] = 1e9
            spilled = await turn(a, configs[0])
            assert spilled == 1 - home
            del a.router.queued[a.prefill.endpoints[home]]
            later = [await turn(b, configs[1]), await turn(a, configs[0]),
                     await turn(b, configs[1])]
            if shared:
                # B heard of A's spill: the conversation follows its latest copy.
                assert later == [spilled] * 3
                assert a.metrics.worker_records_sent.get() >= 2
                assert b"lowproxy_worker_choices_received_total" in b.metrics.render()
            else:
                # B knows only its own first turn: back to home, the cache split in two.
                assert later[0] == home and spilled != home
                assert b"lowproxy_worker_choices" not in b.metrics.render()
        # Closed: each worker's socket is gone with it.
        assert not (tmp_path / "choices-0.sock").exists()


async def test_a_datagram_keyed_otherwise_is_ignored_and_said_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lowproxy.workers")
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        config = config_for([b.url for b in pre], [b.url for b in dec],
                            prefill_policy="cache-aware", workers=2, port=free_port())
        async with worker(config, str(tmp_path), 0) as proxy:
            share = proxy.worker_share
            assert share is not None and proxy.router is not None
            label = pre[0].url.lower().rstrip("/")
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                for probe in (share.probe + 1, share.probe + 2):  # another hash secret
                    sender.sendto(encode(1, probe, share.block_bytes, [(label, [11, 12])]),
                                  socket_path(str(tmp_path), 0))
                sender.sendto(b"not a batch", socket_path(str(tmp_path), 0))
                sender.sendto(encode(1, share.probe, share.block_bytes, [(label, [21, 22])]),
                              socket_path(str(tmp_path), 0))
            finally:
                sender.close()
            await wait_until(lambda: received(proxy) >= 1, what="the good datagram")
            assert proxy.router.prefills.match(label, [21, 22]) == 2
            assert proxy.router.prefills.match(label, [11, 12]) == 0
            said = [r.getMessage() for r in caplog.records if "otherwise" in r.getMessage()]
            assert len(said) == 1 and "worker 1" in said[0], said
            assert any("not a batch" in r.getMessage() for r in caplog.records)


async def test_a_missing_sibling_is_a_counted_drop_and_a_big_flush_is_split(tmp_path):
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        config = config_for([b.url for b in pre], [b.url for b in dec],
                            prefill_policy="cache-aware", workers=3, port=free_port())
        async with worker(config, str(tmp_path), 0) as proxy:
            share = proxy.worker_share
            assert isinstance(share, WorkerShare)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            listener.bind(socket_path(str(tmp_path), 1))  # sibling 1 is up, 2 is not
            listener.setblocking(False)
            try:
                label = pre[0].url.lower().rstrip("/")
                chain = list(range(1, 1001))
                for _ in range(20):  # 20,000 keys: three datagrams
                    share.note(label, chain)
                share.flush()
                datagrams = []
                while True:
                    try:
                        datagrams.append(decode(listener.recv(1 << 20)))
                    except BlockingIOError:
                        break
            finally:
                listener.close()
            assert len(datagrams) == 3
            assert all(sum(len(c) for _, c in d.records) <= MAX_DATAGRAM_KEYS
                       for d in datagrams)
            assert sum(len(d.records) for d in datagrams) == 20
            assert proxy.metrics.worker_records_sent.get() == 20
            assert proxy.metrics.worker_records_dropped.get() == 20  # sibling 2: absent


def metric(text: bytes, name: str) -> float:
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_workers_daemon_counts_what_its_workers_told_each_other():
    async with pd_backends(prefills=2, decodes=1) as (pre, dec):
        daemon = Daemon(["--workers", "2", "--host", "127.0.0.1", "--port", "0",
                         "--prefill", pre[0].url, "--prefill", pre[1].url,
                         "--decode", dec[0].url, "--loop", "asyncio",
                         "--health-interval", "0"], {"PD_PROXY_PREFILL_POLICY": "cache-aware"})
        try:
            port = await asyncio.to_thread(daemon.wait_listening)
            assert await asyncio.to_thread(daemon.wait_listening) == port

            async def both_told() -> bool:
                # Fresh connections: which worker accepts is the kernel's choice.
                for n in range(10):
                    reply = await request(port, "POST", CHAT, turns(f"question {n} " * 20))
                    assert reply.status == 200, reply.body
                scraped = (await request(port, "GET", "/metrics")).body
                return metric(scraped, "lowproxy_worker_choices_received_total") >= 2 \
                    and metric(scraped, "lowproxy_worker_choices_dropped_total") == 0

            for _ in range(30):
                if await both_told():
                    break
            else:
                raise AssertionError(daemon.output())
        finally:
            assert await asyncio.to_thread(daemon.stop) == 0, daemon.output()
