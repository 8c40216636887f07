"""The ``features`` scenario of bench/load.py: what each optional feature costs.

The chat load (relay, --concurrency slots) through a proxy with one feature
on (or as shipped: the defaults), each run right after a run with every
optional feature off (the floor), each a fresh proxy process on the same
emulated backends, for --repeat rounds. A feature's cost is its run's proxy
CPU per request minus the floor run just before it (so a busy spell on the
shared machine hits both): the median and the minimum over rounds are
reported. The backends report cached prompt tokens, so that the usage rewrite
has something to rewrite.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
from typing import Any

from load_client import drive
from load_procs import Backends, ProxyProcess

CLIENT_KEY = "bench-client-key"
# Every optional feature off: the floor each feature's cost is measured from.
FLOOR = {
    "PD_PROXY_PREFILL_POLICY": "round-robin",
    "PD_PROXY_CLIENT_API_KEYS": "",
    "PD_PROXY_BACKEND_API_KEY": "",
    "PD_PROXY_REWRITE_CACHED_TOKENS": "0",
    "PD_PROXY_TRACE": "0",
    "PD_PROXY_OTEL": "0",
    "PD_PROXY_LOG_LEVEL": "warning",  # no access line (it is logged at info)
    "PD_PROXY_LOG_FORMAT": "text",
    "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0",
}
# (row, what turns it on, on by default)
FEATURES: tuple[tuple[str, dict[str, str], bool], ...] = (
    ("cache-aware routing (prefix blocks, decode-first memory)",
     {"PD_PROXY_PREFILL_POLICY": "cache-aware"}, True),
    ("prefill affinity (prompt-prefix key)", {"PD_PROXY_PREFILL_POLICY": "affinity"}, False),
    ("client API keys", {"PD_PROXY_CLIENT_API_KEYS": CLIENT_KEY}, False),
    ("backend API key", {"PD_PROXY_BACKEND_API_KEY": "bench-backend-key"}, False),
    ("usage rewrite (prefill's cached tokens)", {"PD_PROXY_REWRITE_CACHED_TOKENS": "1"}, True),
    ("trace ids (PD_PROXY_TRACE)", {"PD_PROXY_TRACE": "1"}, False),
    ("OpenTelemetry spans", {"PD_PROXY_OTEL": "1"}, False),
    ("access log, text", {"PD_PROXY_LOG_LEVEL": "info"}, True),
    ("access log, JSON", {"PD_PROXY_LOG_LEVEL": "info", "PD_PROXY_LOG_FORMAT": "json"}, False),
    ("active health and model checks", {"PD_PROXY_HEALTH_INTERVAL_SECONDS": "5"}, True),
)
FLOOR_ROW, DEFAULTS_ROW = "every optional feature off (floor)", "as shipped (defaults)"


def _usable(env: dict[str, str]) -> bool:
    return env.get("PD_PROXY_OTEL") != "1" or importlib.util.find_spec("opentelemetry") is not None


def _one(command: list[str], backends: Backends, env: dict[str, str],
         args: argparse.Namespace, kinds: dict[str, int]) -> tuple[float | None, int]:
    """(proxy CPU µs per request, errors) of one chat run; its error kinds added to kinds."""
    settings = argparse.Namespace(**vars(args))
    settings.client_header = (f"authorization: Bearer {CLIENT_KEY}\r\n".encode()
                              if env.get("PD_PROXY_CLIENT_API_KEYS") else b"")
    proxy = ProxyProcess(command, backends, "relay", args.loops[0], env)
    try:
        result = asyncio.run(drive("chat", "proxy", proxy.port, proxy.pid, args.concurrency,
                                   settings, False))
    finally:
        proxy.stop()
    for kind, count in result.error_kinds.items():
        kinds[kind] = kinds.get(kind, 0) + count
    return result.cpu_us_per_request, result.errors


def run(command: list[str], args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """Every round's figures per row, and each feature's cost over the floor beside it."""
    rows = [(name, {**FLOOR, **on}, default) for name, on, default in FEATURES
            if _usable(on)]
    skipped = [name for name, on, _ in FEATURES if not _usable(on)]
    rows.append((DEFAULTS_ROW, {}, None))
    figures: dict[str, list[float]] = {name: [] for name in (FLOOR_ROW, *(r[0] for r in rows))}
    costs: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    errors: dict[str, int] = dict.fromkeys(figures, 0)
    kinds: dict[str, dict[str, int]] = {name: {} for name in figures}
    backends = Backends(args.stream_chunks, 0.0, "--enable-prompt-tokens-details")
    try:
        for round_number in range(1, args.repeat + 1):
            say(f"features (round {round_number} of {args.repeat})")
            for name, env, _ in rows:
                floor, failed = _one(command, backends, dict(FLOOR), args, kinds[FLOOR_ROW])
                errors[FLOOR_ROW] += failed
                cpu, failed = _one(command, backends, env, args, kinds[name])
                errors[name] += failed
                if floor is not None:
                    figures[FLOOR_ROW].append(floor)
                if cpu is not None:
                    figures[name].append(cpu)
                if cpu is not None and floor is not None:
                    costs[name].append(cpu - floor)
    finally:
        backends.stop()
    table = [{"feature": FLOOR_ROW, "default": None, "cpu_us": figures[FLOOR_ROW],
              "cost_median": None, "cost_min": None, "errors": errors[FLOOR_ROW],
              "error_kinds": kinds[FLOOR_ROW]}]
    for name, _, default in rows:
        found = costs[name]
        table.append({"feature": name, "default": default, "cpu_us": figures[name],
                      "cost_median": statistics.median(found) if found else None,
                      "cost_min": min(found) if found else None, "errors": errors[name],
                      "error_kinds": kinds[name]})
    return {"rows": table, "skipped": skipped, "rounds": args.repeat,
            "concurrency": args.concurrency}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}"


def render(document: dict[str, Any]) -> str:
    lines = [f"features: chat c={document['concurrency']}, proxy CPU µs per request, "
             f"{document['rounds']} round(s); cost = run - the floor run just before it "
             "(median, min)",
             f"{'':<42}{'default':>8}{'µs/req (each run)':>30}{'cost med':>10}{'min':>7}"
             f"{'errors':>8}"]
    for row in document["rows"]:
        default = {True: "on", False: "off", None: ""}[row["default"]]
        runs = " ".join(f"{v:.0f}" for v in row["cpu_us"])
        lines.append(f"{row['feature']:<42}{default:>8}{runs:>30}"
                     f"{_cell(row['cost_median']):>10}{_cell(row['cost_min']):>7}"
                     f"{row['errors']:>8}")
        if row.get("error_kinds"):
            lines.append(" " * 4 + "errors: " + ", ".join(
                f"{kind} x{count}" for kind, count in row["error_kinds"].items()))
    for name in document["skipped"]:
        lines.append(f"{name:<42} not measured: its package is not installed")
    return "\n".join(lines)


def markdown(document: dict[str, Any]) -> str:
    lines = [f"`python bench/load.py --scenario features --repeat {document['rounds']}`: "
             f"chat c={document['concurrency']} through a proxy with one optional feature on "
             "(or as shipped), each run right after one with every optional feature off "
             "(the floor); µs of proxy CPU per request, and a feature's cost over the floor "
             "run before it (median / min over the rounds).", "",
             "| feature | default | µs per request: median (min-max, runs) | "
             "cost: median / min |",
             "|---|---|---|---|"]
    for row in document["rows"]:
        default = {True: "on", False: "off", None: ""}[row["default"]]
        values = row["cpu_us"]
        runs = (f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f}, "
                f"{len(values)} runs)" if values else "-")
        if row["errors"]:
            runs += f" ({row['errors']} errors)"
        cost = ("" if row["cost_median"] is None
                else f"{row['cost_median']:+.0f} / {row['cost_min']:+.0f} µs")
        lines.append(f"| {row['feature']} | {default} | {runs} | {cost} |")
    for name in document["skipped"]:
        lines.append(f"| {name} | off | not measured (package not installed) | |")
    return "\n".join(lines)
