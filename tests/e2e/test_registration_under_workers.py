"""Issue 19: with --workers N, /instances/add and /instances/remove are refused (409).

Each worker holds its own backend groups, so a registration would reach only the
worker that took the connection. The refusal is a JSON 409 that says so and
names the settings every worker reads; the GCO call (no type) and the listing
still answer. Over real sockets: the daemon with two workers, and in process.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from helpers import Daemon, config_for, request, running_proxy
from lowproxy.demo import DemoBackend

ADMIN = [("x-admin-api-key", "adm")]


def assert_refused(reply, action: str, workers: int) -> None:
    assert reply.status == 409, reply.body
    error = reply.json()["error"]
    assert error["type"] == "registration_needs_one_worker" and error["code"] == 409
    assert f"instances/{action} is refused with {workers} workers" in error["message"]
    assert "PD_PROXY_DECODE_URL" in error["message"]


async def test_registration_is_refused_in_process_with_workers():
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    other = await DemoBackend("decode").start(bootstrap_port=None)
    try:
        config = config_for((), decode.url, admin_api_key="adm", workers=3)
        async with running_proxy(config) as proxy:
            for action in ("add", "remove"):
                body = {"type": "decode",
                        "instance": other.url if action == "add" else decode.url}
                reply = await proxy.request("POST", f"/instances/{action}", body,
                                            headers=ADMIN)
                assert_refused(reply, action, 3)
            assert [e.label for e in proxy.proxy.decode.endpoints] == [decode.url]
            assert other.received == []  # not even checked
            gco = await proxy.request("POST", "/instances/add", {}, headers=ADMIN)
            assert gco.status == 200 and gco.json() == {"status": "ok"}
            # A bad body is still a 400 first, and the key still guards everything.
            bad = await proxy.request("POST", "/instances/add", {"type": "x"}, headers=ADMIN)
            assert bad.status == 400
            assert (await proxy.request("POST", "/instances/add", {})).status == 403
    finally:
        await decode.close()
        await other.close()


@pytest.mark.parametrize("workers", [2])
async def test_the_daemon_with_workers_refuses_registration_on_every_worker(workers):
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    other = await DemoBackend("decode").start(bootstrap_port=None)
    daemon = Daemon(["--workers", str(workers), "--host", "127.0.0.1", "--port", "0",
                     "--decode", decode.url, "--loop", "asyncio", "--health-interval", "0"],
                    {"ADMIN_API_KEY": "adm"})
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        for _ in range(workers - 1):
            assert await asyncio.to_thread(daemon.wait_listening) == port
        # Many fresh connections: whichever worker takes one, the same refusal.
        for _ in range(8):
            reply = await request(port, "POST", "/instances/add",
                                  {"type": "decode", "instance": other.url}, headers=ADMIN)
            assert_refused(reply, "add", workers)
        listings = [await request(port, "GET", "/instances", headers=ADMIN) for _ in range(8)]
        assert {r.status for r in listings} == {200}
        assert all(r.json()["decode"] == listings[0].json()["decode"] for r in listings)
        assert [entry["instance"] for entry in listings[0].json()["decode"]] == [decode.url]
        assert other.received == []
    finally:
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0, daemon.output()
        await decode.close()
        await other.close()
