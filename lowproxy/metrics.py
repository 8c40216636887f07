"""Counters, gauges and histograms in the Prometheus text format (0.0.4).

No dependency: the hot path does a dict lookup and an add per sample; the text
is built only when /metrics is scraped. Gauges that describe state owned
elsewhere (pools, cooldowns, caches) are read at scrape time from callbacks.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import resource
import time
from typing import Callable, Iterable

LabelValues = tuple[str, ...]

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Iterable[str], values: Iterable[str], extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=False)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Counter:
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help, labels
        self.values: dict[LabelValues, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def samples(self) -> Iterable[str]:
        for labels, value in self.values.items():
            yield f"{self.name}{_labels(self.labelnames, labels)} {_number(value)}"


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (),
                 read: Callable[[], Iterable[tuple[LabelValues, float]]] | None = None) -> None:
        self.name, self.help, self.labelnames = name, help, labels
        self.values: dict[LabelValues, float] = {}
        self.read = read

    def add(self, amount: float, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def samples(self) -> Iterable[str]:
        items = self.read() if self.read is not None else self.values.items()
        for labels, value in items:
            yield f"{self.name}{_labels(self.labelnames, labels)} {_number(value)}"


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = DURATION_BUCKETS) -> None:
        self.name, self.help, self.labelnames = name, help, labels
        self.buckets = buckets
        # per label values: [count per bucket (non-cumulative)..., +Inf], sum
        self.values: dict[LabelValues, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        entry = self.values.get(labels)
        if entry is None:
            entry = self.values[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1][0] += value

    def count(self, *labels: str) -> int:
        entry = self.values.get(labels)
        return sum(entry[0]) if entry else 0

    def samples(self) -> Iterable[str]:
        for labels, (counts, total) in self.values.items():
            running = 0
            for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                running += count
                le = 'le="' + _number(bound) + '"'
                yield f"{self.name}_bucket{_labels(self.labelnames, labels, le)} {running}"
            yield f"{self.name}_sum{_labels(self.labelnames, labels)} {_number(total[0])}"
            yield f"{self.name}_count{_labels(self.labelnames, labels)} {running}"


def _process_samples() -> Iterable[tuple[str, str, str, float]]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    yield ("process_cpu_seconds_total", "counter", "User and system CPU time spent.",
           usage.ru_utime + usage.ru_stime)
    rss = None
    try:
        with open("/proc/self/statm", "rb") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if rss is not None:
        yield ("process_resident_memory_bytes", "gauge", "Resident memory size.", rss)
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = None
    if fds is not None:
        yield ("process_open_fds", "gauge", "Open file descriptors.", fds)


class Metrics:
    """Every metric lowproxy exports; one instance per process, owned by the Proxy."""

    def __init__(self) -> None:
        self.started = time.time()
        self.requests = Counter("lowproxy_requests_total",
                                "Client requests answered, by route class and status.",
                                ("route", "status"))
        self.prefill_legs = Counter(
            "lowproxy_prefill_legs_total",
            "Prefill legs by handshake and outcome (ok, error, timeout, recompute, rejected, "
            "skipped; skipped ones also by reason).",
            ("handshake", "outcome", "reason"))
        self.decode_legs = Counter(
            "lowproxy_decode_legs_total",
            "Decode legs by outcome (ok, unreachable, error, timeout, truncated, client-gone).",
            ("outcome",))
        self.request_duration = Histogram("lowproxy_request_duration_seconds",
                                          "Whole client request duration.", ("route",))
        self.prefill_duration = Histogram("lowproxy_prefill_duration_seconds",
                                          "Prefill leg duration.", ("handshake",))
        self.decode_first_byte = Histogram(
            "lowproxy_decode_first_byte_seconds",
            "From the client's request to decode's first body byte (the client's TTFT).")
        self.bootstrap_duration = Histogram("lowproxy_bootstrap_query_duration_seconds",
                                            "Mooncake bootstrap /query duration.", ("outcome",))
        self.client_connections = Gauge("lowproxy_client_connections",
                                        "Client connections open.")
        self.in_flight = Gauge("lowproxy_requests_in_flight", "Client requests in flight.")
        self.upstream_connections = Gauge(
            "lowproxy_upstream_connections",
            "Upstream connections by role, endpoint and state (open, idle).",
            ("role", "endpoint", "state"))
        self.cooldown = Gauge("lowproxy_endpoints_in_cooldown",
                              "Endpoints skipped after a failed connection.", ("role",))
        self.bootstrap_entries = Gauge("lowproxy_bootstrap_cache_entries",
                                       "Prefill endpoints with a cached bootstrap map.")
        self.tasks = Gauge("lowproxy_asyncio_tasks",
                           "asyncio tasks alive in this process (a leak shows here first).",
                           read=lambda: [((), len(asyncio.all_tasks()))])
        self.client_connections.set(0)
        self.in_flight.set(0)

    def families(self) -> list:
        return [self.requests, self.prefill_legs, self.decode_legs, self.request_duration,
                self.prefill_duration, self.decode_first_byte, self.bootstrap_duration,
                self.client_connections, self.in_flight, self.upstream_connections,
                self.cooldown, self.bootstrap_entries, self.tasks]

    def render(self) -> bytes:
        lines: list[str] = []
        for family in self.families():
            lines.append(f"# HELP {family.name} {family.help}")
            lines.append(f"# TYPE {family.name} {family.kind}")
            lines.extend(family.samples())
        for name, kind, help, value in _process_samples():
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {_number(value)}")
        lines.append("# HELP process_start_time_seconds Start time since the epoch.")
        lines.append("# TYPE process_start_time_seconds gauge")
        lines.append(f"process_start_time_seconds {_number(self.started)}")
        return ("\n".join(lines) + "\n").encode()
