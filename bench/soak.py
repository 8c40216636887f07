#!/usr/bin/env python3
"""Soak lowproxy: sustained load with injected faults, then check that nothing leaked.

    python bench/soak.py                     # 10 minutes, relay handshake
    python bench/soak.py --duration 60 --kv-protocol mooncake --concurrency 32

The proxy runs as its own process (``python -m lowproxy`` with PD_PROXY_*
variables); this script runs the emulated backends and the load clients. A
share of requests (``--fault-rate``) asks for a fault: the backends read it
from the request body (a ``soak_fault`` field the proxy forwards untouched)
and misbehave on that request only; client faults are played by the client.

  decode_dies      decode sends two events, then drops the connection
  decode_closes    decode closes without answering
  decode_500       decode answers 500
  decode_slow      decode waits up to a second before answering
  prefill_500      prefill answers 500 (the proxy recomputes on decode; 502 under sglang)
  prefill_hang     prefill never answers (bounded by the prefill timeout)
  vanish_body      the client hangs up in the middle of its request body
  vanish_stream    the client hangs up in the middle of a streamed answer
  garbage          the client sends bytes that are not HTTP
  slow_reader      the client reads a long stream slowly
  decode_stray_same   decode's answer ends, and a second whole response follows
                      in the same write
  decode_stray_later  the same stray response as a write of its own, a moment later,
                      while the connection is idle in the proxy's pool (the gate
                      skips it when the proxy has already sent its next request:
                      a stray that arrives after that is, to any HTTP/1.1 client,
                      the answer; "strays_later" in the summary counts them,
                      and one that crossed the proxy's next request is not
                      held against the proxy: "crossed a stray")
  decode_hostile_usage  decode's usage has the wrong types or a number JSON cannot
                      carry once parsed (1e400, NaN): the proxy's cached-token rewrite
                      (the prefill reports its figure) must relay it byte for byte
  decode_hangs_up     decode reads the whole POST and hangs up before any response
                      byte (the first time it sees that request; a repeat is served)
  decode_cl_chunked   decode's answer carries Content-Length beside
                      Transfer-Encoding: chunked

The last four break HTTP framing, so decode is reached through a gate (a small
HTTP/1.1 relay, bench/soak_backends.py) that plays them on the raw bytes and
echoes each request's ``soak_id`` as an ``x-soak-id`` response header.

Every request ends in one of: the answer expected for its fault ("served" when
that is a 200, "failed as expected" otherwise), "answered wrong" (another
request's answer or a stray one, told by x-soak-id, or a body that is not what
decode sent, or Content-Length beside Transfer-Encoding), "unexpected" (an
answer, but not the expected one), "lost" (no answer and no error: the
connection closed without a status line, or nothing came within
--request-timeout) or "vanished" (the client left on purpose, vanish_body and
vanish_stream: not a failure, one per such fault played). A stray response names
the answer it trailed in its x-soak-id (stray-same-s12, stray-later-s12). The backends
count the generation requests they receive per soak id: one received twice is
"generated twice" (the proxy sent a POST again, RFC 9110 9.2.2).

Throughout the run /healthz is asked every --healthz-every seconds on a fresh
connection; "healthz_failed" counts the probes not answered 200 within 5 s (the
proxy must never stop answering, whatever it is fed).

At the end the load stops, the proxy settles (idle upstream connections expire
after PD_PROXY_UPSTREAM_IDLE_SECONDS=2) and its open descriptors, asyncio
tasks, RSS and /metrics gauges are compared with the baseline. Progress is
printed every --report-every seconds, and a JSON summary last.
Exit status 0 when nothing was lost, unexpected, answered wrong or generated
twice and descriptors and tasks came back to the baseline; 1 otherwise. Linux
only (/proc). ``--faults`` narrows the kinds played (comma-separated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # lowproxy from this checkout
sys.path.insert(0, HERE)  # the soak_* modules beside this file

from soak_backends import FaultGate, FaultyBackend, start_backends  # noqa: E402
from soak_client import CHAT, FAULTS, Soak, chat_body, one_request  # noqa: E402
from soak_proxy import (  # noqa: E402
    back_at,
    proxy_state,
    settle,
    start_proxy,
    stop_proxy,
    wait_ready,
)


def say(text: str) -> None:
    print(text, flush=True)


def generated_twice(prefill: FaultyBackend, gate: FaultGate) -> dict[str, int]:
    """Soak ids generated more than once: a prefill or a decode that received one twice.

    But for a prefill fault, decode counts what it answered: under a concurrent
    handshake the decode leg sent beside a prefill that then fails is held
    until the proxy closes it (decode, waiting for that prefill's KV, aborts
    it having generated nothing), and the recompute after it is the one
    generation. Every other fault counts what decode received, so a POST sent
    again after decode took it (no POST replay) shows whether decode answered
    the first or not."""
    twice = {f"prefill {i} ({prefill.fault_of[i]})": n
             for i, n in prefill.received_ids.items() if n > 1}
    for i, n in gate.received.items():
        fault = gate.fault_of[i]
        count = gate.answered[i] if fault.startswith("prefill_") else n
        if count > 1:
            twice[f"decode {i} ({fault})"] = count
    return twice


async def watch_healthz(port: int, every: float, stop_at: float, probes: Counter[str]) -> None:
    """/healthz on a fresh connection every ``every`` seconds until ``stop_at``."""
    while time.monotonic() < stop_at:
        try:
            reply = await one_request(port, b"GET", b"/healthz", None, timeout=5)
            probes["ok" if reply.status == 200 else "failed"] += 1
        except (asyncio.TimeoutError, ConnectionError, OSError):
            probes["failed"] += 1
        await asyncio.sleep(every)


async def load(args: argparse.Namespace, proc: Any, port: int,
               gate: FaultGate) -> tuple[Soak, list[Any], float]:
    """The soak itself: workers until --duration, a progress line every --report-every."""
    soak = Soak(args, port)
    soak.crossed, soak.pending = gate.crossed, gate.pending  # the same sets, shared
    started = time.monotonic()
    soak.stop_at = started + args.duration
    workers = [asyncio.create_task(soak.worker()) for _ in range(args.concurrency)]
    workers.append(asyncio.create_task(
        watch_healthz(port, args.healthz_every, soak.stop_at, soak.healthz)))
    while not all(w.done() for w in workers):
        await asyncio.wait(workers, timeout=args.report_every)
        if proc.poll() is not None:
            say(f"proxy exited with {proc.returncode} during the soak")
            break
        elapsed = time.monotonic() - started
        done = sum(soak.outcomes.values())
        state = await proxy_state(proc, port)
        say(f"[{elapsed:6.0f}s] requests {done} ({done / max(elapsed, 1e-9):.0f}/s) "
            f"faults {sum(soak.faults.values())} {dict(soak.outcomes)} "
            f"healthz {dict(soak.healthz)} "
            f"fds {state['fds']} tasks {state.get('lowproxy_asyncio_tasks')} "
            f"rss {state['rss_kib']} KiB")
    failed = [w.exception() for w in workers if w.done() and w.exception() is not None]
    for exc in failed:
        say(f"worker failed: {exc!r}")
    return soak, failed, time.monotonic() - started


def summarise(args: argparse.Namespace, soak: Soak, elapsed: float, twice: dict[str, int],
              before: dict[str, Any], after: dict[str, Any], alive: bool,
              workers_failed: bool) -> dict[str, Any]:
    outcomes = soak.outcomes
    summary = {
        "duration_s": round(elapsed, 1), "kv_protocol": args.kv_protocol,
        "requests": sum(outcomes.values()), "served": outcomes["served"],
        "failed_as_expected": outcomes["failed as expected"],
        "vanished": outcomes["vanished"], "crossed_a_stray": outcomes["crossed a stray"],
        "lost": outcomes["lost"],
        "unexpected": outcomes["unexpected"], "answered_wrong": outcomes["answered wrong"],
        "generated_twice": len(twice), "bad_by_fault": soak.bad_by_fault(),
        "generated_twice_by_fault": dict(Counter(key.split("(")[1].rstrip(")")
                                                 for key in twice)),
        "faults_injected": sum(soak.faults.values()), "faults": dict(soak.faults),
        "healthz_ok": soak.healthz["ok"], "healthz_failed": soak.healthz["failed"],
        "proxy_alive": alive, "proxy_before": before, "proxy_after": after,
        "fds_leaked": (after.get("fds", 0) - before["fds"]) if alive else None,
        "tasks_leaked": (after.get("lowproxy_asyncio_tasks", 0)
                         - before.get("lowproxy_asyncio_tasks", 0)) if alive else None,
    }
    summary["ok"] = (alive and not workers_failed and back_at(before, after)
                     and not any(summary[key] for key in
                                 ("lost", "unexpected", "answered_wrong", "generated_twice",
                                  "healthz_failed")))
    return summary


async def run(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    prefill, decode, gate = await start_backends()
    proc, port = start_proxy(args, prefill.url, prefill.bootstrap_port, gate.url)
    try:
        if not await wait_ready(proc, port, 20):
            say(f"proxy did not start (exit {proc.poll()}); see {args.proxy_log}")
            return 1
        # Warm up, then let the pools empty: the baseline is a quiet proxy.
        for stream in (False, True):
            await one_request(port, b"POST", CHAT, chat_body(None, stream, 4), timeout=10)
        before = await settle(proc, port, None, 10)
        say(f"soak: proxy pid {proc.pid} port {port} ({args.kv_protocol}), "
            f"{args.duration:g}s, concurrency {args.concurrency}, fault rate {args.fault_rate}")
        say(f"before: {json.dumps(before)}")
        soak, failed, elapsed = await load(args, proc, port, gate)
        alive = proc.poll() is None
        after = await settle(proc, port, before, args.settle) if alive else {}
        say(f"after:  {json.dumps(after)}")
        twice = generated_twice(prefill, gate)
        for line in soak.details + [f"TWICE {key}: {n} times" for key, n in
                                    list(twice.items())[:20]]:
            say(f"  {line}")
        summary = summarise(args, soak, elapsed, twice, before, after, alive, bool(failed))
        summary["strays_later"] = dict(gate.strays)  # how much decode_stray_later tested
        say(json.dumps({"soak": summary}))
        return 0 if summary["ok"] else 1
    finally:
        stop_proxy(proc)
        await gate.close()
        await prefill.close()
        await decode.close()


def fault_list(text: str) -> list[str]:
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault kinds {unknown}; known: {FAULTS}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--fault-rate", type=float, default=0.3,
                        help="share of requests that ask for a fault")
    parser.add_argument("--faults", type=fault_list, default=list(FAULTS),
                        help="comma-separated fault kinds to play (default: all)")
    parser.add_argument("--kv-protocol", choices=("relay", "mooncake", "sglang"),
                        default="relay")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--report-every", type=float, default=30.0)
    parser.add_argument("--healthz-every", type=float, default=0.5,
                        help="seconds between /healthz probes during the load")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="seconds the proxy gets to close everything after the load")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="the proxy's event loop (PD_PROXY_LOOP)")
    parser.add_argument("--proxy-log", help="where the proxy's log goes",
                        default=os.path.join("/tmp", f"soak-proxy-{os.getpid()}.log"))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
