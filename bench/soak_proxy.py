"""The soak's proxy: a ``python -m lowproxy`` child process and what it holds open."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

from common import ROOT, free_port
from soak_client import one_request

GAUGES = ("lowproxy_client_connections", "lowproxy_requests_in_flight",
          "lowproxy_upstream_connections", "process_open_fds", "lowproxy_asyncio_tasks")


def start_proxy(args: argparse.Namespace, prefill_url: str, bootstrap_port: int,
                decode_url: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    env.update({
        "PYTHONPATH": ROOT, "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(port),
        "PD_PROXY_PREFILL_URL": f"{prefill_url}#bootstrap_port={bootstrap_port}",
        "PD_PROXY_DECODE_URL": decode_url, "PD_PROXY_KV_PROTOCOL": args.kv_protocol,
        "PD_PROXY_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port),
        "PD_PROXY_PREFILL_TIMEOUT_SECONDS": "1", "PD_PROXY_UPSTREAM_IDLE_SECONDS": "2",
        "PD_PROXY_LOG_LEVEL": "warning", "PD_PROXY_LOOP": args.loop,
    })
    log = open(args.proxy_log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "lowproxy"], env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, port


async def wait_ready(proc: subprocess.Popen, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            reply = await one_request(port, b"GET", b"/readyz", None, timeout=2)
            if reply.status == 200:
                return True
        except OSError:
            pass
        await asyncio.sleep(0.1)
    return False


def stop_proxy(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def scrape(port: int) -> dict[str, float]:
    """Gauges from GET /metrics (summed over labels); lowproxy_upstream_connections: open."""
    reply = await one_request(port, b"GET", b"/metrics", None, timeout=10)
    found: dict[str, float] = {}
    if reply.status != 200:
        return found
    for line in reply.body.decode("utf-8", "replace").splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name in GAUGES:
            if name == "lowproxy_upstream_connections" and 'state="open"' not in name_labels:
                continue
            found[name] = found.get(name, 0.0) + float(value)
    found["lowproxy_client_connections"] = found.get("lowproxy_client_connections", 1) - 1
    return found  # (less this scrape's own connection)


async def proxy_state(proc: subprocess.Popen, port: int) -> dict[str, Any]:
    state: dict[str, Any] = {"fds": open_fds(proc.pid), "rss_kib": rss_kib(proc.pid)}
    state.update(await scrape(port))
    return state


async def settle(proc: subprocess.Popen, port: int, baseline: dict[str, Any] | None,
                 seconds: float) -> dict[str, Any]:
    """Wait until no client or upstream connection is open and, given a baseline, until
    descriptors and asyncio tasks are back at it."""
    deadline = time.monotonic() + seconds
    while True:
        state = await proxy_state(proc, port)
        quiet = (state.get("lowproxy_client_connections", 0) <= 0
                 and state.get("lowproxy_requests_in_flight", 0) <= 0
                 and state.get("lowproxy_upstream_connections", 0) <= 0
                 and (baseline is None or back_at(baseline, state)))
        if quiet or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


def back_at(baseline: dict[str, Any], state: dict[str, Any]) -> bool:
    """Descriptors and asyncio tasks no more than before the load."""
    return (state.get("fds", 10**9) <= baseline["fds"]
            and state.get("lowproxy_asyncio_tasks", 10**9)
            <= baseline.get("lowproxy_asyncio_tasks", 10**9))
