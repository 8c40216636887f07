"""--workers N: one port bound by the parent, workers that come back, one /metrics view."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket

import pytest

from helpers import Daemon, chat, follow_output, free_port, request, wait_until
from lowproxy.demo import DemoBackend, KvRegistry
from lowproxy.downstream import HttpServer


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


def metric(text: bytes, name: str) -> float:
    """The sum of every sample of ``name`` in a text exposition."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(value) for value in re.findall(pattern, text.decode(), re.M))


async def scrape(port: int) -> bytes:
    reply = await request(port, "GET", "/metrics")
    assert reply.status == 200, reply.body
    return reply.body


async def demo(role: str, registry: KvRegistry, accepted: list[int] | None = None
               ) -> DemoBackend:
    backend = DemoBackend(role, registry=registry)
    if accepted is not None:
        backend.server = HttpServer(backend.handle, on_connections=accepted.append)
    await backend.start(bootstrap_port=None)
    return backend


def worker_daemon(prefill: DemoBackend, decode: DemoBackend, *extra: str,
                  env: dict[str, str] | None = None) -> Daemon:
    return Daemon(["--workers", "2", "--host", "127.0.0.1", "--port", "0",
                   "--prefill", prefill.url, "--decode", decode.url, "--loop", "asyncio",
                   # no health checks: the backends' counts are the requests' alone
                   "--health-interval", "0", *extra], env)


async def started(daemon: Daemon, workers: int = 2) -> int:
    port = await asyncio.to_thread(daemon.wait_listening)
    for _ in range(workers - 1):  # each worker logs its own "listening on"
        assert await asyncio.to_thread(daemon.wait_listening) == port
    return port


def stop(daemon: Daemon) -> None:
    """Kill what a failed test left running; close the pipes either way."""
    if daemon.proc.poll() is None:
        daemon.proc.kill()
        daemon.proc.wait()
    daemon.output()


async def test_two_workers_serve_one_port_and_exit_zero_on_sigterm():
    registry = KvRegistry()
    accepted: list[int] = []
    prefill = await demo("prefill", registry)
    decode = await demo("decode", registry, accepted)
    daemon = worker_daemon(prefill, decode)
    try:
        port = await started(daemon)
        workers = children_of(daemon.proc.pid)
        assert len(workers) == 2, workers
        # Both workers accept on the one inherited socket; which one wins a
        # connection is the kernel's choice, so keep sending fresh connections
        # until each worker has opened its own pooled decode connection.
        served = 0
        while accepted.count(1) < 2:
            assert served < 300, "one worker never served"
            reply = await request(port, "POST", "/v1/chat/completions", chat())
            assert reply.status == 200, reply.body
            served += 1
        assert len(decode.requests_to("/chat/completions")) == served
        assert len(prefill.requests_to("/chat/completions")) == served
        status = await asyncio.to_thread(daemon.stop, signal.SIGTERM)
        assert status == 0, daemon.output()
        assert "started 2 workers" in daemon.output()
        for pid in workers:
            assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived the parent"
    finally:
        stop(daemon)
        await decode.close()
        await prefill.close()


@pytest.mark.parametrize("first_workers, second_workers", [(2, 1), (1, 2), (2, 2)])
async def test_a_second_lowproxy_on_the_same_port_fails_at_start(first_workers,
                                                                  second_workers):
    port = free_port()
    first = Daemon(["--workers", str(first_workers), "--host", "127.0.0.1", "--port",
                    str(port)])
    try:
        await started(first, first_workers)
        second = Daemon(["--workers", str(second_workers), "--host", "127.0.0.1",
                         "--port", str(port)])
        assert await asyncio.to_thread(second.proc.wait, 30) == 2
        lines = [line for line in second.output().splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert "address in use" in lines[0] and str(port) in lines[0]
        assert "Traceback" not in second.output()
        assert (await request(port, "GET", "/healthz")).status == 200
    finally:
        assert await asyncio.to_thread(first.stop, signal.SIGTERM) == 0
        stop(first)


async def test_a_killed_worker_is_restarted_and_its_counts_remain():
    registry = KvRegistry()
    prefill = await demo("prefill", registry)
    decode = await demo("decode", registry)
    daemon = worker_daemon(prefill, decode)
    try:
        port = await started(daemon)
        follow_output(daemon)
        for _ in range(10):
            assert (await request(port, "POST", "/v1/chat/completions", chat())).status == 200

        async def generation_count() -> float:
            return metric(await scrape(port), "lowproxy_request_duration_seconds_count")

        # Every worker writes its values at least once a second: the sum catches up.
        async def counted_all() -> bool:
            return await generation_count() >= 10
        for _ in range(100):
            if await counted_all():
                break
            await asyncio.sleep(0.05)
        assert await generation_count() == 10
        before = await scrape(port)
        victim, survivor = children_of(daemon.proc.pid)
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: "killed by signal 9" in daemon.output(), 10, "restart log")
        await wait_until(lambda: len(children_of(daemon.proc.pid)) == 2, 10, "a new worker")
        assert survivor in children_of(daemon.proc.pid)
        assert victim not in children_of(daemon.proc.pid)
        # The dead worker's counts are still in the sum: nothing went down.
        for _ in range(5):
            after = await scrape(port)
            for name in ("lowproxy_request_duration_seconds_count",
                         "process_cpu_seconds_total"):
                assert metric(after, name) >= metric(before, name), name
        assert metric(after, 'lowproxy_requests_total{route="generation",status="200"}') \
            == 10
        assert (await request(port, "POST", "/v1/chat/completions", chat())).status == 200
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0, daemon.output()
    finally:
        stop(daemon)
        await decode.close()
        await prefill.close()


async def test_gauges_are_summed_over_live_workers_and_metrics_port_serves_them():
    registry = KvRegistry()
    prefill = await demo("prefill", registry)
    decode = await demo("decode", registry)
    metrics_port = free_port()
    daemon = worker_daemon(prefill, decode, "--metrics-port", str(metrics_port))
    try:
        port = await started(daemon)
        # lowproxy's own only on the metrics port: the main port's /metrics is
        # decode's, as through the GCO proxy and llm-d's sidecar.
        main = await request(port, "GET", "/metrics")
        assert main.status == 200 and b"vllm:num_requests_waiting" in main.body
        assert b"lowproxy_" not in main.body
        # Each worker reports its own asyncio tasks; the sum counts both processes,
        # so it is above what one worker alone has (its maintenance task and the
        # task serving this scrape, at least).
        body = await scrape(metrics_port)
        assert metric(body, "process_open_fds") > 0
        for _ in range(100):
            body = await scrape(metrics_port)
            if len(re.findall(r"^lowproxy_asyncio_tasks ", body.decode(), re.M)) == 1 and \
                    metric(body, "lowproxy_asyncio_tasks") >= 4:
                break
            await asyncio.sleep(0.05)
        assert metric(body, "lowproxy_asyncio_tasks") >= 4, body.decode()
        assert body.decode().count("# TYPE lowproxy_requests_total counter") == 1
    finally:
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0
        stop(daemon)
        await decode.close()
        await prefill.close()


async def test_sigterm_drains_a_request_in_flight_on_every_worker():
    registry = KvRegistry()
    prefill = await demo("prefill", registry)
    decode = await demo("decode", registry)
    daemon = worker_daemon(prefill, decode)
    try:
        port = await started(daemon)
        decode.faults.delay = 1.0
        slow = [asyncio.create_task(request(port, "POST", "/v1/chat/completions", chat()))
                for _ in range(4)]
        await wait_until(lambda: len(decode.received) == 4, 10, "requests at decode")
        daemon.proc.send_signal(signal.SIGTERM)
        for reply in await asyncio.gather(*slow):
            assert reply.status == 200, reply.body
        assert await asyncio.to_thread(daemon.proc.wait, 30) == 0, daemon.output()
    finally:
        stop(daemon)
        await decode.close()
        await prefill.close()


async def test_a_worker_that_keeps_dying_is_restarted_with_back_off(tmp_path):
    # A worker re-reads the CA file at start: removed after the parent checked
    # it, every restart fails until it is back.
    import trustme

    ca_file = str(tmp_path / "ca.pem")
    trustme.CA().cert_pem.write_to_path(ca_file)
    registry = KvRegistry()
    prefill = await demo("prefill", registry)
    decode = await demo("decode", registry)
    daemon = worker_daemon(prefill, decode, "--ca-file", ca_file)
    try:
        port = await started(daemon)
        follow_output(daemon)
        os.rename(ca_file, ca_file + ".away")
        victim = children_of(daemon.proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: "restarting in 1s" in daemon.output(), 15, "back-off")
        output = daemon.output()
        assert "exited with status 2" in output and "restarting in 0.5s" in output
        assert output.index("restarting in 0.5s") < output.index("restarting in 1s")
        assert (await request(port, "GET", "/healthz")).status == 200  # the other serves
        shutil.move(ca_file + ".away", ca_file)
        await wait_until(lambda: len(children_of(daemon.proc.pid)) == 2
                         and daemon.output().count("listening on") >= 3, 15, "recovered")
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0
    finally:
        stop(daemon)
        await decode.close()
        await prefill.close()


async def test_a_start_mistake_in_a_worker_stops_the_daemon_with_status_2():
    """A mistake found only in the worker (here the demo's fixed ports, taken) used
    to restart it for ever, each time with its traceback, while the parent held the
    port. A worker's first start ending with status 2 now stops them all: exit 2."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        daemon = Daemon(["--workers", "2", "--host", "127.0.0.1", "--port", "0", "--demo",
                         "--loop", "asyncio",
                         f"--demo-args=--prefill-port {port} --decode-port {free_port()}"])
        try:
            assert await asyncio.to_thread(daemon.proc.wait, 30) == 2
            output = daemon.output()
            assert "Traceback" not in output and "restarting" not in output, output
            assert "PD_PROXY_DEMO_ARGS" in output and "could not start" in output
        finally:
            stop(daemon)
    finally:
        taken.close()


async def test_a_connection_made_during_the_drain_is_refused_not_left_hanging():
    """The parent held its copy of the listening socket through the drain, so the
    port stayed in LISTEN: a connection made then hung to the drain's end and was
    reset (a POST sent on it lost). The parent now closes its copy at the signal."""
    registry = KvRegistry()
    prefill = await demo("prefill", registry)
    decode = await demo("decode", registry)
    daemon = worker_daemon(prefill, decode, "--drain", "10")
    try:
        port = await started(daemon)
        decode.faults.delay = 3.0  # a request in flight keeps the drain going
        slow = asyncio.create_task(request(port, "POST", "/v1/chat/completions", chat()))
        await wait_until(lambda: len(decode.received) == 1, 10, "request at decode")
        daemon.proc.send_signal(signal.SIGTERM)

        async def refused() -> bool:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                return True
            writer.close()
            return False

        deadline = asyncio.get_running_loop().time() + 2.0
        while not await refused():
            assert asyncio.get_running_loop().time() < deadline, "still accepting"
            await asyncio.sleep(0.05)
        assert (await slow).status == 200  # what was in flight still finishes
        assert await asyncio.to_thread(daemon.proc.wait, 30) == 0, daemon.output()
    finally:
        stop(daemon)
        await decode.close()
        await prefill.close()
