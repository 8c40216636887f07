"""--workers N: processes sharing one port through SO_REUSEPORT, stopped by one SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal

from helpers import Daemon, chat, request
from lowproxy.demo import DemoBackend, start_pair
from lowproxy.server import HttpServer


def children_of(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
            found.append(int(name))
    return found


async def test_two_workers_serve_one_port_and_exit_zero_on_sigterm():
    prefill, _ = await start_pair()  # its decode is unused: ours counts connections
    decode = DemoBackend("decode", registry=prefill.registry)
    accepted = []
    decode.server = HttpServer(decode.handle, on_connections=accepted.append)
    await decode.start(bootstrap_port=None)
    daemon = Daemon(["--workers", "2", "--host", "127.0.0.1", "--port", "0",
                     "--prefill", prefill.url, "--decode", decode.url])
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        # Each worker logs its own "listening on": wait for the second one too, or
        # early connections could all reach the only socket listening yet.
        assert await asyncio.to_thread(daemon.wait_listening) == port
        workers = children_of(daemon.proc.pid)
        assert len(workers) == 2, workers
        # Sequential requests, each on a fresh client connection: the kernel
        # spreads the connections over both workers' sockets, and each worker
        # reuses its own pooled upstream connection.
        for _ in range(24):
            reply = await request(port, "POST", "/v1/chat/completions", chat())
            assert reply.status == 200, reply.body
            assert reply.json()["choices"][0]["message"]["content"]
        assert len(decode.requests_to("/chat/completions")) == 24
        assert len(prefill.requests_to("/chat/completions")) == 24
        # One decode connection per worker that served: both did (the odds that
        # the kernel sent all 24 connections to one socket are 2^-23).
        assert accepted.count(1) == 2, accepted
        status = await asyncio.to_thread(daemon.stop, signal.SIGTERM)
        assert status == 0, daemon.output()
        assert "started 2 workers" in daemon.output()
        for pid in workers:
            assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived the parent"
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
        await decode.close()
        await prefill.close()

