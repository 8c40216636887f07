"""Counters, gauges and histograms in the Prometheus text format (0.0.4).

No dependency: the hot path does a dict lookup and an add per sample; the text
is built only when /metrics is scraped. Gauges that describe state owned
elsewhere (pools, cooldowns, caches) are read at scrape time from callbacks.
With several workers on one port, a scrape answered by any worker sums every
worker's snapshot (``Metrics.peers``, fed by metrics_share): one view of the
whole server.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import resource
import time
from typing import Any, Callable, Iterable

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


def process_figures() -> dict[str, float]:
    """This process's CPU seconds, resident bytes and open fds (what /proc tells)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    figures = {"cpu": usage.ru_utime + usage.ru_stime}
    try:
        with open("/proc/self/statm", "rb") as statm:
            figures["rss"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        figures["fds"] = len(os.listdir("/proc/self/fd"))
    except OSError:
        pass
    return figures


PROCESS_FAMILIES = (
    ("cpu", "process_cpu_seconds_total", "counter", "User and system CPU time spent."),
    ("rss", "process_resident_memory_bytes", "gauge", "Resident memory size."),
    ("fds", "process_open_fds", "gauge", "Open file descriptors."),
)

# One process's values, as written for the other workers (metrics_share):
# {"families": {name: [[labels, value-or-[counts, sum]], ...]}, "process": {...},
#  "started": t}. Plain JSON types only.
Snapshot = dict
# Given this process's snapshot, the other workers' snapshots, each with
# whether that worker is still alive (a dead one's gauges no longer count).
Peers = Callable[[Snapshot], list[tuple[Snapshot, bool]]]


def merge(snapshots: list[tuple[Snapshot, bool]], gauges: set[str]) -> Snapshot:
    """Sum snapshots: counters and histograms over every worker that ever ran
    (so a restarted worker's counts do not vanish and nothing decreases), gauges
    and per-process sizes over the live ones; CPU seconds over all."""
    families: dict[str, dict[tuple[str, ...], Any]] = {}
    process: dict[str, float] = {}
    started = min((snap["started"] for snap, _ in snapshots), default=time.time())
    for snap, alive in snapshots:
        for name, items in snap["families"].items():
            if name in gauges and not alive:
                continue
            merged = families.setdefault(name, {})
            for labels, value in items:
                key = tuple(labels)
                if isinstance(value, list):  # histogram: [counts per bucket, sum]
                    old = merged.get(key)
                    if old is None:
                        merged[key] = [list(value[0]), value[1]]
                    else:
                        old[0] = [a + b for a, b in zip(old[0], value[0], strict=True)]
                        old[1] += value[1]
                else:
                    merged[key] = merged.get(key, 0.0) + value
        for figure, value in snap["process"].items():
            if alive or figure == "cpu":
                process[figure] = process.get(figure, 0.0) + value
    return {"families": {name: [[list(k), v] for k, v in items.items()]
                         for name, items in families.items()},
            "process": process, "started": started}


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
        # per endpoint (issue 15); health and in flight are read from the groups
        self.endpoint_requests = Counter(
            "lowproxy_endpoint_requests_total",
            "Requests sent to each backend endpoint (every attempt), by role.",
            ("role", "endpoint"))
        self.endpoint_failures = Counter(
            "lowproxy_endpoint_failures_total",
            "Failures of each backend endpoint: unreachable (a connection failed under a "
            "request) or health (a failed health check).", ("role", "endpoint", "kind"))
        self.endpoint_health = Gauge(
            "lowproxy_endpoint_health",
            "1 for each endpoint's health state (healthy, unhealthy, unknown: not checked "
            "yet); summed over workers, the workers that see it so.",
            ("role", "endpoint", "state"))
        self.endpoint_in_flight = Gauge("lowproxy_endpoint_in_flight",
                                        "Requests in flight on each backend endpoint.",
                                        ("role", "endpoint"))
        self.endpoint_engine_load = Gauge(
            "lowproxy_endpoint_engine_load",
            "What each engine last reported of its load (ORCA header, /metrics): waiting, "
            "running, kv_usage; absent for an engine that reports nothing.",
            ("role", "endpoint", "metric"))
        self.prefill_choice = Counter(
            "lowproxy_prefill_choice_total",
            "Prefill endpoint choices by reason (header, affinity, load, only, round-robin).",
            ("reason",))
        # The prefills' prefix-cache hit rate, when they report cached tokens
        # (vLLM --enable-prompt-tokens-details): cached / prompt tokens.
        self.prefill_prompt_tokens = Counter(
            "lowproxy_prefill_prompt_tokens_total",
            "Prompt tokens of the prefill legs whose answer reported cached tokens.",
            ("handshake",))
        self.prefill_cached_tokens = Counter(
            "lowproxy_prefill_cached_tokens_total",
            "Prompt tokens the prefill found in its prefix cache (same legs).", ("handshake",))
        # PD_PROXY_PEERS (routing/peers.py): prefill choices told to and by other replicas
        self.peer_batches_sent = Counter(
            "lowproxy_peer_batches_sent_total",
            "Batches of prefill choices a peer replica accepted, by peer.", ("peer",))
        self.peer_records_sent = Counter(
            "lowproxy_peer_records_sent_total",
            "Prefill choices a peer replica accepted, by peer.", ("peer",))
        self.peer_records_dropped = Counter(
            "lowproxy_peer_records_dropped_total",
            "Prefill choices not told to a peer (it was busy, down or failed, or a batch "
            "was full), by peer.", ("peer",))
        self.peer_send_failures = Counter(
            "lowproxy_peer_send_failures_total",
            "Batches a peer did not accept, by peer and kind (unreachable, timeout, "
            "refused).", ("peer", "kind"))
        self.peer_batches_received = Counter(
            "lowproxy_peer_batches_received_total",
            "Batches received from peers, by outcome (recorded, own, refused).", ("outcome",))
        self.peer_records_received = Counter(
            "lowproxy_peer_records_received_total",
            "Prefill choices received from peers, by outcome (recorded; unknown: a prefill "
            "not configured here).", ("outcome",))
        self.peer_up = Gauge("lowproxy_peer_up",
                             "1 for a peer that accepted its last batch, 0 once one failed.",
                             ("peer",))
        self.peers_on = False  # set with PD_PROXY_PEERS: the families above are exported
        # --workers with cache-aware routing (routing/worker_share.py): prefill choices
        # told to and by the daemon's other workers; summed over workers as all are.
        self.worker_records_sent = Counter(
            "lowproxy_worker_choices_sent_total",
            "Prefill choices this daemon's workers told each other (one per sibling).")
        self.worker_records_dropped = Counter(
            "lowproxy_worker_choices_dropped_total",
            "Prefill choices not told to a sibling worker (restarting, its buffer full, "
            "or too many waiting for one flush).")
        self.worker_records_received = Counter(
            "lowproxy_worker_choices_received_total",
            "Prefill choices recorded from sibling workers.")
        self.worker_share_on = False  # set with --workers and cache-aware routing
        self.client_connections.set(0)
        self.in_flight.set(0)
        # (version, python, loop) of this process, set once its loop runs; the same
        # in every worker, so a scrape shows it once, not summed.
        self.build_info: tuple[str, str, str] | None = None
        # Set by the daemon when workers share one port: the other workers' values.
        self.peers: Peers | None = None

    def families(self) -> list:
        return [self.requests, self.prefill_legs, self.decode_legs, self.request_duration,
                self.prefill_duration, self.decode_first_byte, self.bootstrap_duration,
                self.client_connections, self.in_flight, self.upstream_connections,
                self.cooldown, self.bootstrap_entries, self.tasks, self.endpoint_requests,
                self.endpoint_failures, self.endpoint_health, self.endpoint_in_flight,
                self.endpoint_engine_load, self.prefill_choice, self.prefill_prompt_tokens,
                self.prefill_cached_tokens, *(self.peer_families() if self.peers_on else ()),
                *((self.worker_records_sent, self.worker_records_dropped,
                   self.worker_records_received) if self.worker_share_on else ())]

    def peer_families(self) -> list:
        return [self.peer_batches_sent, self.peer_records_sent, self.peer_records_dropped,
                self.peer_send_failures, self.peer_batches_received, self.peer_records_received,
                self.peer_up]

    def snapshot(self) -> Snapshot:
        """This process's values in plain JSON types (gauge callbacks read now)."""
        families: dict[str, list[list[Any]]] = {}
        for family in self.families():
            if isinstance(family, Histogram):
                families[family.name] = [[list(labels), [list(counts), total[0]]]
                                         for labels, (counts, total) in family.values.items()]
            else:
                items = family.read() if getattr(family, "read", None) else family.values.items()
                families[family.name] = [[list(labels), value] for labels, value in items]
        return {"families": families, "process": process_figures(), "started": self.started}

    def render(self) -> bytes:
        """The text exposition: this process alone, or summed with its peers."""
        own = self.snapshot()
        snapshots = [(own, True)]
        if self.peers is not None:
            snapshots += self.peers(own)
        gauges = {f.name for f in self.families() if f.kind == "gauge"}
        merged = merge(snapshots, gauges)
        lines: list[str] = []
        for family in self.families():
            lines.append(f"# HELP {family.name} {family.help}")
            lines.append(f"# TYPE {family.name} {family.kind}")
            items = merged["families"].get(family.name, [])
            if isinstance(family, Histogram):
                lines.extend(_histogram_lines(family, items))
            else:
                lines.extend(f"{family.name}{_labels(family.labelnames, labels)} "
                             f"{_number(value)}" for labels, value in items)
        if self.build_info is not None:
            lines.append("# HELP lowproxy_build_info The running build: lowproxy version, "
                         "Python version, event loop.")
            lines.append("# TYPE lowproxy_build_info gauge")
            lines.append("lowproxy_build_info"
                         f"{_labels(('version', 'python', 'loop'), self.build_info)} 1")
        for figure, name, kind, help in PROCESS_FAMILIES:
            if figure in merged["process"]:
                lines.append(f"# HELP {name} {help}")
                lines.append(f"# TYPE {name} {kind}")
                lines.append(f"{name} {_number(merged['process'][figure])}")
        lines.append("# HELP process_start_time_seconds Start time since the epoch.")
        lines.append("# TYPE process_start_time_seconds gauge")
        lines.append(f"process_start_time_seconds {_number(merged['started'])}")
        return ("\n".join(lines) + "\n").encode()


def _histogram_lines(family: Histogram, items: list[list[Any]]) -> Iterable[str]:
    for labels, (counts, total) in items:
        running = 0
        for bound, count in zip((*family.buckets, float("inf")), counts, strict=True):
            running += count
            le = 'le="' + _number(bound) + '"'
            yield f"{family.name}_bucket{_labels(family.labelnames, labels, le)} {running}"
        yield f"{family.name}_sum{_labels(family.labelnames, labels)} {_number(total)}"
        yield f"{family.name}_count{_labels(family.labelnames, labels)} {running}"
