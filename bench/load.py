#!/usr/bin/env python3
"""Load benchmark for lowproxy, or any PD proxy that reads PD_PROXY_* variables.

    python bench/load.py                      # every scenario, both loops, one table each
    python bench/load.py --repeat 2           # the whole table twice: the spread
    python bench/load.py --markdown           # the README's speed table
    python bench/load.py --json               # the same, as one JSON document
    python bench/load.py --from-json run.json --markdown   # render a saved run again
    python bench/load.py --scenario chat --proxy-cmd "python3 /path/other_proxy.py"
    python bench/load.py --plot charts/         # also PNG charts (needs matplotlib)

Three kinds of process, so none steals the others' measurements: emulated
backends (``python -m lowproxy.demo``: prefill, decode and a Mooncake bootstrap
server), the proxy under test (a fresh process per scenario, started with
PD_PROXY_HOST/PORT/PREFILL_URL/DECODE_URL/KV_PROTOCOL/MOONCAKE_BOOTSTRAP_PORT)
and this script, whose load client is raw asyncio streams with a minimal
HTTP/1.1 reader and one keep-alive connection per concurrency slot. Each
scenario is also sent straight to the decode backend, and every figure is
quoted as a ratio to that run: what the proxy costs.

Figures: requests/s, p50/p99 latency, CPU time per request and per relayed SSE
event (utime+stime from /proc, of the proxy and its children; of the backends
in direct runs), peak RSS (VmHWM) and, for idle-streams, the RSS each open
stream costs; then the targets of issue 16 with PASS/FAIL. Linux only (/proc).
No dependency beyond the standard library. The modules beside this file:
load_procs (processes, /proc), load_client (load client), load_streams
(trickle, idle-streams), load_report (figures, targets), load_render (output).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import sys
from dataclasses import asdict
from typing import Any

import load_features
import load_plot
import load_prefix
from load_client import Result, drive, prefill_leg_body
from load_peer import PEER_SCENARIOS, PeerProcess, available
from load_procs import Backends, ProxyProcess, raise_fd_limit
from load_render import FOOTNOTE, markdown, summary, table
from load_report import evaluate, group_by_run
from load_streams import idle_streams, trickle

SCENARIOS = ("chat", "latency", "mooncake", "stream", "trickle", "workers", "idle-streams")
# Not in "all", each with its own table: load_prefix.py (fresh backends per cell) and
# load_features.py (chat with each optional feature on and off).
OWN_TABLE = ("prefix", "features")
NEEDS_CHAT = ("trickle", "workers")  # their figures are relative to chat's of the same run
LOOPS = ("asyncio", "uvloop", "auto")


def proxy_command(args: argparse.Namespace) -> list[str]:
    if args.proxy_cmd:
        return shlex.split(args.proxy_cmd)
    return [sys.executable, "-m", "lowproxy"]


def extra_env(args: argparse.Namespace) -> dict[str, str]:
    env = {}
    for item in args.proxy_env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--proxy-env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env


def run_fast(scenario: str, backends: Backends, args: argparse.Namespace,
             loop: str) -> list[Result]:
    """chat, mooncake, stream, workers: the proxy, then the same load to decode
    (workers has no direct run of its own: it is chat's)."""
    stream = scenario == "stream"
    kv_protocol = "mooncake" if scenario == "mooncake" else "relay"
    env = extra_env(args)
    if scenario == "workers":
        env["PD_PROXY_WORKERS"] = str(args.workers)
    proxy = ProxyProcess(proxy_command(args), backends, kv_protocol, loop, env)
    try:
        results = [asyncio.run(drive(scenario, "proxy", proxy.port, proxy.pid,
                                     args.concurrency, args, stream,
                                     backend_pid=backends.pid))]
    finally:
        proxy.stop()
    if args.peer and scenario in PEER_SCENARIOS:
        peer = PeerProcess(args.peer, backends, kv_protocol)
        try:
            results.append(asyncio.run(drive(scenario, "peer", peer.port, peer.pid,
                                             args.concurrency, args, stream,
                                             backend_pid=backends.pid)))
        finally:
            peer.stop()
    if scenario != "workers":
        results.append(asyncio.run(drive(scenario, "direct", backends.decode_port,
                                         backends.pid, args.concurrency, args, stream)))
    return results


def run_latency(backends: Backends, args: argparse.Namespace, loop: str) -> list[Result]:
    """Concurrency 1 through the proxy, straight to decode, and a prefill leg straight
    to prefill: the proxy's p50 is at best decode's own plus prefill's own."""
    proxy = ProxyProcess(proxy_command(args), backends, "relay", loop, extra_env(args))
    try:
        through = asyncio.run(drive("latency", "proxy", proxy.port, proxy.pid, 1, args, False,
                                    backend_pid=backends.pid))
    finally:
        proxy.stop()
    results = [through]
    if args.peer:
        peer = PeerProcess(args.peer, backends, "relay")
        try:
            results.append(asyncio.run(drive("latency", "peer", peer.port, peer.pid, 1, args,
                                             False, backend_pid=backends.pid)))
        finally:
            peer.stop()
    direct = asyncio.run(drive("latency", "direct", backends.decode_port, backends.pid, 1,
                               args, False))
    prefill = asyncio.run(drive("latency", "prefill", backends.prefill_port, backends.pid, 1,
                                args, False, body=prefill_leg_body()))
    return [*results, direct, prefill]


def run_trickle(args: argparse.Namespace, loop: str) -> list[Result]:
    """A decode that sends one event per --trickle-interval, through the proxy and direct."""
    backends = Backends(args.trickle_events, args.trickle_interval)
    try:
        proxy = ProxyProcess(proxy_command(args), backends, "relay", loop, extra_env(args))
        try:
            results = [asyncio.run(trickle("proxy", proxy.port, proxy.pid, args))]
        finally:
            proxy.stop()
        if args.peer:
            peer = PeerProcess(args.peer, backends, "relay")
            try:
                results.append(asyncio.run(trickle("peer", peer.port, peer.pid, args)))
            finally:
                peer.stop()
        results.append(asyncio.run(trickle("direct", backends.decode_port, backends.pid,
                                           args)))
    finally:
        backends.stop()
    return results


def run_idle(args: argparse.Namespace, loop: str) -> list[Result]:
    """Slow streams: a separate, slow decode; the proxy's RSS; then decode's own."""
    chunks = int((args.timeout + args.idle_streams / 100 + args.idle_settle + args.idle_hold)
                 / args.idle_chunk_delay) + 60
    results = []
    backends = Backends(chunks, args.idle_chunk_delay)
    try:
        proxy = ProxyProcess(proxy_command(args), backends, "relay", loop, extra_env(args))
        try:
            results.append(asyncio.run(idle_streams("proxy", proxy.port, proxy.pid, args)))
        finally:
            proxy.stop()
    finally:
        backends.stop()
    # Direct, on fresh backends: the decode's own memory per stream, for comparison.
    backends = Backends(chunks, args.idle_chunk_delay)
    try:
        results.append(asyncio.run(idle_streams("direct", backends.decode_port, backends.pid,
                                                args)))
    finally:
        backends.stop()
    return results


def run_all(args: argparse.Namespace, loop: str, run: int) -> list[Result]:
    """Every selected scenario once, on one event loop."""
    results: list[Result] = []

    def say(scenario: str) -> None:
        if not args.json:
            print(f"running {scenario} (loop {loop}, run {run}) ...", file=sys.stderr,
                  flush=True)

    fast = [s for s in args.scenarios if s not in ("trickle", "idle-streams", *OWN_TABLE)]
    if fast:
        backends = Backends(args.stream_chunks, 0.0)
        try:
            for scenario in fast:
                say(scenario)
                if scenario == "latency":
                    results.extend(run_latency(backends, args, loop))
                else:
                    results.extend(run_fast(scenario, backends, args, loop))
        finally:
            backends.stop()
    for scenario, runner in (("trickle", run_trickle), ("idle-streams", run_idle)):
        if scenario in args.scenarios:
            say(scenario)
            results.extend(runner(args, loop))
    for r in results:
        r.loop, r.run = loop, run
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/load.py", description="Load benchmark for lowproxy or any PD proxy "
        "that reads PD_PROXY_* variables. Linux only (/proc).")
    add = parser.add_argument
    add("--scenario", default="all",
        help=f"comma-separated, of {', '.join(SCENARIOS + OWN_TABLE)}; or all (default: "
        "every one but prefix). trickle and workers bring chat along: their figures are "
        "relative to it")
    add("--concurrency", type=int, default=32,
        help="connections in flight for chat, mooncake, stream and workers (default 32; "
        "latency always runs at 1)")
    add("--duration", type=float, default=5.0,
        help="seconds recorded per run, after the warm-up (default 5)")
    add("--requests", type=int, default=0,
        help="record this many requests per run instead of --duration")
    add("--warmup", type=float, default=1.0,
        help="seconds of load before recording starts (default 1)")
    add("--repeat", type=int, default=1, help="run the whole table this many times (spread)")
    add("--proxy-cmd", default="",
        help="command starting the proxy under test; it must honour PD_PROXY_HOST/PORT/"
        "PREFILL_URL/DECODE_URL/KV_PROTOCOL/MOONCAKE_BOOTSTRAP_PORT (default: this "
        "Python -m lowproxy)")
    add("--peer", default="", metavar="NAME",
        help="also run this peer proxy against the same backends, side by side, and quote "
        "the proxy's figures as ratios to it: vllm-router (pip install vllm-router); "
        "skipped with a message when it is not installed")
    add("--proxy-env", action="append", default=[], metavar="KEY=VALUE",
        help="extra environment for the proxy (repeatable)")
    add("--loop", default="both",
        help="PD_PROXY_LOOP for the proxy: asyncio, uvloop, auto, a comma-separated list, "
        "or both (default: asyncio then uvloop; uvloop dropped when it is not installed)")
    add("--stream-chunks", type=int, default=64,
        help="SSE chunks per streamed response (default 64)")
    add("--trickle-streams", type=int, default=200,
        help="trickle: concurrent streams (default 200)")
    add("--trickle-events", type=int, default=100,
        help="trickle: SSE events per stream (default 100)")
    add("--trickle-interval", type=float, default=0.02,
        help="trickle: seconds between a stream's events (default 0.02)")
    add("--trickle-rounds", type=int, default=2,
        help="trickle: measured rounds of --trickle-streams streams, after one unmeasured "
        "round (default 2)")
    add("--workers", type=int, default=2, help="workers: PD_PROXY_WORKERS (default 2)")
    add("--idle-streams", type=int, default=2000,
        help="slow streams held open at once (default 2000)")
    add("--idle-chunk-delay", type=float, default=1.0,
        help="seconds between chunks of a slow stream (default 1)")
    add("--idle-settle", type=float, default=1.0,
        help="seconds after all slow streams opened before RSS is read")
    add("--idle-hold", type=float, default=3.0,
        help="seconds the slow streams trickle while CPU is measured")
    add("--timeout", type=float, default=30.0, help="per-request timeout")
    add("--json", action="store_true", help="print one JSON document instead of the table")
    add("--json-file", default="", metavar="PATH", help="also write the JSON document to PATH")
    add("--markdown", action="store_true",
        help="also print the README's speed table (markdown) after the tables")
    add("--from-json", default="", metavar="PATH",
        help="run nothing: render the document a --json-file run saved")
    add("--plot", default="", metavar="DIR",
        help="also write PNG charts to DIR: latency CDF direct vs through the proxy, CPU "
        "per request per scenario (needs matplotlib: pip install 'lowproxy[bench]')")
    add("--plot-peer", action="append", default=[], metavar="PATH",
        help="with --plot: another proxy's saved --json-file run, drawn beside (repeatable)")
    add("--check", action="store_true",
        help="exit 1 when a target fails or any request failed")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    names = SCENARIOS if args.scenario == "all" else tuple(
        s.strip() for s in args.scenario.split(",") if s.strip())
    unknown = [s for s in names if s not in SCENARIOS + OWN_TABLE]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from "
                     f"{', '.join(SCENARIOS + OWN_TABLE)}")
    if any(s in NEEDS_CHAT for s in names) and "chat" not in names:
        names = ("chat", *names)
    args.scenarios = tuple(s for s in SCENARIOS + OWN_TABLE if s in names)
    loops = ("asyncio", "uvloop") if args.loop == "both" else tuple(
        s.strip() for s in args.loop.split(",") if s.strip())
    if not loops or any(loop not in LOOPS for loop in loops):
        parser.error(f"--loop {args.loop!r}: choose from {', '.join(LOOPS)}, a list, or both")
    if (args.loop == "both" and not args.proxy_cmd
            and importlib.util.find_spec("uvloop") is None):
        print("uvloop is not installed: --loop asyncio only", file=sys.stderr)
        loops = ("asyncio",)
    args.loops = loops
    if args.peer:
        why_not = available(args.peer)
        if why_not is not None:
            print(why_not, file=sys.stderr)
            args.peer = ""
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.plot and not load_plot.available():  # before the load, not after it
        parser.exit(2, f"bench/load.py: {load_plot.HINT}\n")


SETTINGS = ("cpus", "peer", "scenarios", "loops", "repeat", "concurrency", "duration",
            "requests", "warmup",
            "stream_chunks", "trickle_streams", "trickle_events", "trickle_interval",
            "trickle_rounds", "workers", "idle_streams", "idle_chunk_delay", "timeout")


def report(results: list[Result], settings: argparse.Namespace) -> dict[str, Any]:
    """The JSON document: every row, and per loop and run its figures and targets."""
    runs: list[dict[str, Any]] = [
        {"loop": loop, "run": run, "figures": evaluate(group, settings)}
        for (loop, run), group in group_by_run(results).items()]
    return {"proxy_cmd": settings.proxy_cmd_list, "cpus": settings.cpus,
            "settings": {key: getattr(settings, key) for key in SETTINGS},
            "results": [asdict(r) for r in results], "runs": runs,
            "targets": [dict(e, loop=run["loop"], run=run["run"]) for run in runs
                        for e in run["figures"] if e["pass"] is not None]}


def render(document: dict[str, Any], settings: argparse.Namespace, with_markdown: bool) -> str:
    if not document["runs"]:
        return ""  # only the scenarios with tables of their own ran (prefix, features)
    results = [Result(**r) for r in document["results"]]
    groups = group_by_run(results)
    per_run = (f"{settings.requests} requests" if settings.requests
               else f"{settings.duration:g}s")
    parts = []
    for run in document["runs"]:
        title = (f"lowproxy bench: proxy {' '.join(document['proxy_cmd'])!r}, loop "
                 f"{run['loop']}, run {run['run']} of {settings.repeat}, {document['cpus']} "
                 f"cpus, {per_run} per run")
        parts.append(table(groups[(run["loop"], run["run"])], run["figures"], title))
    if len(document["runs"]) > 1:
        parts.append(summary(document["runs"]))
    parts.append(FOOTNOTE)
    if with_markdown:
        parts.append(markdown(document["runs"], settings, document["cpus"]))
    return "\n\n".join(parts)


def from_json(args: argparse.Namespace) -> int:
    with open(args.from_json) as f:
        document = json.load(f)
    settings = argparse.Namespace(**document["settings"])
    print(render(document, settings, args.markdown))
    if "features" in document:
        print("\n" + load_features.render(document["features"]))
        if args.markdown:
            print("\n" + load_features.markdown(document["features"]))
    plot(document, args)
    return 0


def plot(document: dict[str, Any], args: argparse.Namespace) -> None:
    if args.plot:
        for path in load_plot.plot(document, args.plot, load_plot.load_peers(args.plot_peer)):
            print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return from_json(args)
    if not os.path.exists("/proc/self/stat"):
        print("bench/load.py needs Linux /proc", file=sys.stderr)
        return 2
    limit = raise_fd_limit()
    if "idle-streams" in args.scenarios and limit < args.idle_streams + 256:
        print(f"warning: RLIMIT_NOFILE {limit} is low for {args.idle_streams} streams",
              file=sys.stderr)
    args.proxy_cmd_list, args.cpus = proxy_command(args), os.cpu_count()
    results: list[Result] = []
    # Loops interleaved within each repeat, so a busy spell on the machine hits both.
    for run in range(1, args.repeat + 1):
        for loop in args.loops:
            results.extend(run_all(args, loop, run))
    document = report(results, args)
    if "prefix" in args.scenarios:
        if not args.json:
            print("running prefix (each policy on fresh backends) ...", file=sys.stderr)
        document["prefix"] = load_prefix.run(args.proxy_cmd_list)
    if "features" in args.scenarios:
        document["features"] = load_features.run(
            args.proxy_cmd_list, args,
            lambda what: None if args.json else print(f"running {what} ...", file=sys.stderr,
                                                      flush=True))
    text = json.dumps(document, indent=2)
    if args.json_file:
        with open(args.json_file, "w") as f:
            f.write(text + "\n")
    print(text if args.json else render(document, args, args.markdown))
    if "prefix" in document and not args.json:
        print("\n" + load_prefix.render(document["prefix"]))
    if "features" in document and not args.json:
        print("\n" + load_features.render(document["features"]))
        if args.markdown:
            print("\n" + load_features.markdown(document["features"]))
    plot(document, args)
    failed = any(r.errors for r in results) or not all(t["pass"] for t in document["targets"])
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
