"""What the engines themselves report of their load, so every replica sees the same.

Two sources, both vLLM 0.33's own:

- the ORCA report vLLM puts on a non-streamed answer when asked
  (``endpoint-load-metrics-format: TEXT``): every prefill leg asks, and its
  answer brings that prefill's queue and KV usage back at no cost;
- ``GET /metrics`` every health interval, read from every endpoint: vLLM's
  ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
  ``vllm:kv_cache_usage_perc``, or SGLang's ``sglang:num_queue_reqs``,
  ``sglang:num_running_reqs`` and ``sglang:token_usage`` (summed over engines
  and ranks; usage: the highest).

A backend that reports nothing (no ``/metrics``, no header, an unknown format)
simply has no report: the choice then goes by the proxy's own counts. A report
older than REPORT_TTL_SECONDS is not used. ``/metrics`` is not read with the
interval 0 (lowproxy then sends backends nothing of its own).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Iterable

from ..timeouts import deadline
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Upstream, UpstreamError
from .groups import BackendGroup

log = logging.getLogger("lowproxy.engine_load")

ORCA_HEADER = b"endpoint-load-metrics"
ASK_ORCA = (b"endpoint-load-metrics-format", b"TEXT")
METRICS_TARGET = b"/metrics"
MAX_METRICS_BYTES = 4 * 1024 * 1024
REPORT_TTL_SECONDS = 30.0
FIELDS = ("waiting", "running", "kv_usage")
# Prometheus name (without labels) -> our field; counts are summed, usage is the highest.
_PROMETHEUS = {
    "vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage",
    "sglang:num_queue_reqs": "waiting", "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_usage",
}
_ORCA = {"num_requests_waiting": "waiting", "num_requests_running": "running",
         "kv_cache_usage_perc": "kv_usage"}


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") and value >= 0 else None


def parse_orca(value: bytes) -> dict[str, float]:
    """The fields of an ``endpoint-load-metrics`` header (TEXT or JSON); {} if none."""
    text = value.decode("latin-1").strip()
    kind, _, rest = text.partition(" ")
    found: dict[str, float] = {}
    if kind.upper() == "TEXT":
        for item in rest.split(","):
            name, _, number = item.strip().partition("=")
            field = _ORCA.get(name.removeprefix("named_metrics."))
            parsed = _number(number.strip())
            if field is not None and parsed is not None:
                found[field] = parsed
    elif kind.upper() == "JSON":
        try:
            document = json.loads(rest)
        except ValueError:
            return {}
        named = document.get("named_metrics") if isinstance(document, dict) else None
        for name, number in (named.items() if isinstance(named, dict) else ()):
            field = _ORCA.get(name)
            if field is not None and isinstance(number, (int, float)) \
                    and not isinstance(number, bool):
                parsed = _number(str(number))
                if parsed is not None:
                    found[field] = parsed
    return found


def parse_prometheus(text: str) -> dict[str, float]:
    """The load fields of a Prometheus text exposition; {} if it has none."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = _PROMETHEUS.get(name)
        if field is None:
            continue
        value = _number(line.rsplit(" ", 1)[-1])
        if value is None:
            continue
        if field == "kv_usage":
            found[field] = max(found.get(field, 0.0), value)
        else:
            found[field] = found.get(field, 0.0) + value
    return found


class EngineLoads:
    """The last report of each endpoint, and the loop reading ``/metrics``."""

    def __init__(self, upstream: Upstream, groups: tuple[BackendGroup, ...],
                 interval: float, timeout: float, headers: Any = None) -> None:
        self.upstream = upstream
        self.groups = groups
        self.interval = interval
        self.timeout = timeout
        self.headers = headers  # a callable giving the backend key's headers
        self.reports: dict[Endpoint, tuple[float, dict[str, float]]] = {}
        self.silent: set[Endpoint] = set()  # answered /metrics with nothing usable
        self._task: asyncio.Task[None] | None = None

    def record(self, endpoint: Endpoint, fields: dict[str, float]) -> None:
        if fields:
            known = self.reports.get(endpoint)
            merged = {**known[1], **fields} if known is not None else dict(fields)
            self.reports[endpoint] = (time.monotonic(), merged)

    def orca(self, endpoint: Endpoint, value: bytes | None) -> None:
        """A prefill leg's answer header (None: it brought none)."""
        if value is not None:
            self.record(endpoint, parse_orca(value))

    def get(self, endpoint: Endpoint, field: str) -> float | None:
        known = self.reports.get(endpoint)
        if known is None or time.monotonic() - known[0] > REPORT_TTL_SECONDS:
            return None
        return known[1].get(field)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.interval > 0:
            self._task = loop.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=1.0)

    async def _run(self) -> None:
        while True:
            endpoints = [e for group in self.groups for e in group.endpoints]
            await asyncio.gather(*(self.read(endpoint) for endpoint in endpoints))
            present = set(endpoints)
            for gone in [endpoint for endpoint in self.reports if endpoint not in present]:
                del self.reports[gone]
            self.silent &= present
            await asyncio.sleep(self.interval)

    async def read(self, endpoint: Endpoint) -> None:
        """One ``GET /metrics``; a failure or an answer without load leaves no report."""
        headers = self.headers() if self.headers is not None else []
        try:
            async with deadline(self.timeout):
                response = await self.upstream.request(endpoint, b"GET", METRICS_TARGET,
                                                       headers, None)
                try:
                    raw = await response.read(MAX_METRICS_BYTES)
                finally:
                    await response.aclose()
        except (TimeoutError, UpstreamError) as exc:
            log.debug("GET /metrics on %s failed: %s", endpoint.label, exc or "timed out")
            return
        fields = parse_prometheus(raw.decode("utf-8", "replace")) \
            if 200 <= response.status < 300 else {}
        if fields:
            self.silent.discard(endpoint)
            self.record(endpoint, fields)
        elif endpoint not in self.silent:
            self.silent.add(endpoint)
            log.info("%s reports no load on /metrics (%d): choices use lowproxy's own counts",
                     endpoint.label, response.status)

    def gauges(self) -> Iterable[tuple[tuple[str, ...], float]]:
        """lowproxy_endpoint_engine_load{role,endpoint,metric}: what was last read."""
        for group in self.groups:
            for endpoint in group.endpoints:
                for field in FIELDS:
                    value = self.get(endpoint, field)
                    if value is not None:
                        yield (group.role, endpoint.label, field), value


__all__ = ["ASK_ORCA", "ORCA_HEADER", "EngineLoads", "parse_orca", "parse_prometheus"]
