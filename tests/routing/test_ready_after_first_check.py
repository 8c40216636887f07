"""Issue 19: /readyz never answers 200 before the first health check of decode has run.

The proxy runs its first round of checks before it reports ready (bounded by
PD_PROXY_HEALTH_TIMEOUT_SECONDS), and a decode that never passed a check is out
at its first failure, whatever PD_PROXY_HEALTH_FAILURES allows a flapping one.
A decode whose first check is still running is "not checked yet". Over sockets.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from helpers import (
    Daemon,
    ScriptedBackend,
    config_for,
    free_port,
    request,
    running_proxy,
    wait_until,
)
from lowproxy.demo import DemoBackend

CHECKS = {"health_interval": 30.0, "health_timeout": 1.0, "health_failures": 3}


async def test_an_unreachable_decode_is_never_ready():
    nothing = f"http://127.0.0.1:{free_port()}"  # refuses every connection
    async with running_proxy(config_for((), nothing, **CHECKS)) as running:
        ready = await running.request("GET", "/readyz")
        assert ready.status == 503, ready.body
        assert ready.json()["reason"] == "no healthy decode endpoint"
        assert (await running.request("GET", "/healthz")).status == 200


async def hang(request: Any, responder: Any) -> None:
    await asyncio.Event().wait()


async def test_a_decode_whose_first_check_hangs_is_not_ready():
    hung = await ScriptedBackend(hang).start()
    try:
        async with running_proxy(config_for((), hung.url(), **CHECKS)) as running:
            ready = await running.request("GET", "/readyz")
            assert ready.status == 503, ready.body
            assert ready.json()["reason"] in ("decode not checked yet",
                                              "no healthy decode endpoint")
            assert (await running.request("GET", "/healthz")).status == 200
    finally:
        await hung.close()


async def test_a_live_decode_is_ready_and_known_as_soon_as_the_proxy_serves():
    decode = await DemoBackend("decode").start(bootstrap_port=None)
    try:
        async with running_proxy(config_for((), decode.url, **CHECKS)) as running:
            assert (await running.request("GET", "/readyz")).status == 200
            group = running.proxy.decode
            assert group.health_state(group.endpoints[0]) == "healthy"
            assert group.endpoints[0] in group.models
    finally:
        await decode.close()


async def test_the_daemon_reports_ready_only_after_checking_decode():
    daemon = Daemon(["--host", "127.0.0.1", "--port", "0"], env={
        "PD_PROXY_DECODE_URL": f"http://127.0.0.1:{free_port()}",
        "PD_PROXY_HEALTH_INTERVAL_SECONDS": "30", "PD_PROXY_HEALTH_FAILURES": "3"})
    try:
        port = daemon.wait_listening()
        ready = await request(port, "GET", "/readyz")
        assert ready.status == 503 and ready.json()["reason"] == "no healthy decode endpoint"
    finally:
        assert daemon.stop() == 0


async def test_the_line_taking_a_decode_out_says_why_its_check_failed(caplog):
    """"(last: no answer)" told an operator nothing: the line now carries the
    connect, TLS or timeout failure of the check, and a reset with no text is named."""
    caplog.set_level(logging.WARNING, logger="lowproxy")
    nothing = f"http://127.0.0.1:{free_port()}"
    plain = await DemoBackend("decode").start()  # plain HTTP, named https: TLS fails
    hung = await ScriptedBackend(hang).start()
    try:
        decodes = [nothing, plain.url.replace("http://", "https://"), hung.url()]
        async with running_proxy(config_for((), decodes, **CHECKS)):
            def out_lines() -> list[str]:
                return [r.getMessage() for r in caplog.records if " is out: " in r.getMessage()]
            await wait_until(lambda: len(out_lines()) == 3, 10, "three decodes out")
        lines = out_lines()
        assert all("no answer)" not in line for line in lines), lines
        assert all(not line.rstrip(")").endswith("failed: ") for line in lines), lines
        by_backend = {decode: next(line for line in lines if decode.lower() in line)
                      for decode in decodes}
        assert "connect to" in by_backend[nothing]
        assert "within 1s" in by_backend[hung.url()]
    finally:
        await plain.close()
        await hung.close()
