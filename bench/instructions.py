"""Instructions per request: the proxy's own user-space cost, counted, not timed.

CPU time on a shared 2-core machine moves by ±15 % between runs, more than
most single changes to the hot path are worth. valgrind's callgrind counts the
instructions the proxy executes (the kernel's share, the syscalls, is not
counted), which repeat to ±0.2 %: the measure for A/B work on the hot path and
for what each optional feature costs.

The proxy starts under callgrind with counting off (start-up and imports are
not counted), takes ``--warmup`` requests, counts ``--requests`` more at
``--concurrency`` in flight, and stops. Needs valgrind (``apt install
valgrind``); slow (about 50 times), so a run is a few hundred requests.

    python bench/instructions.py                     # chat relay, as shipped
    python bench/instructions.py --kv-protocol mooncake --stream
    python bench/instructions.py --features          # the cost table of bench/load_features.py
    python bench/instructions.py --proxy-env PD_PROXY_LOG_LEVEL=warning
    python bench/instructions.py --keep /tmp/relay.callgrind   # then callgrind_annotate
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from common import ROOT, free_port
from load_client import Connection, chat_body, request_bytes
from load_features import DEFAULTS_ROW, FEATURES, FLOOR, FLOOR_ROW
from load_procs import Backends, child_env


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited {proc.returncode} under callgrind")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("proxy did not listen under callgrind")


async def _send(port: int, payload: bytes, requests: int, concurrency: int) -> int:
    """``requests`` exchanges over ``concurrency`` keep-alive connections; the non-200s."""
    left = [requests]
    failed = [0]

    async def slot(connection: Connection) -> None:
        while left[0] > 0:
            left[0] -= 1
            status, _, _ = await connection.exchange(payload, 120.0)
            failed[0] += status != 200

    connections = [Connection(port) for _ in range(concurrency)]
    try:
        await asyncio.gather(*(slot(c) for c in connections))
    finally:
        for connection in connections:
            connection.close()
    return failed[0]


def count(backends: Backends, env: dict[str, str], args: argparse.Namespace) -> float:
    """Thousands of instructions the proxy executes per request, under ``env``."""
    port = free_port()
    out = tempfile.mkdtemp(prefix="lowproxy-callgrind-")
    proxy_env = child_env({
        "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(port),
        "PD_PROXY_PREFILL_URL": backends.prefill_url, "PD_PROXY_DECODE_URL": backends.decode_url,
        "PD_PROXY_KV_PROTOCOL": args.kv_protocol,
        "PD_PROXY_MOONCAKE_BOOTSTRAP_PORT": str(backends.bootstrap_port),
        "PD_PROXY_LOOP": args.loop, "PD_PROXY_DRAIN_SECONDS": "1", **env})
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={out}/counted.%p", sys.executable, "-m", "lowproxy"]
    with open(os.path.join(out, "proxy.log"), "wb") as log:
        proxy = subprocess.Popen(command, env=proxy_env, stdout=log, stderr=log, cwd=ROOT)
    try:
        _wait_listening(port, proxy, 180.0)
        header = (b"authorization: Bearer bench-client-key\r\n"
                  if env.get("PD_PROXY_CLIENT_API_KEYS") else b"")
        payload = request_bytes(port, "/v1/chat/completions", chat_body(args.stream), header)
        asyncio.run(_send(port, payload, args.warmup, args.concurrency))
        subprocess.run(["callgrind_control", "--instr=on", str(proxy.pid)], check=True,
                       capture_output=True)
        failed = asyncio.run(_send(port, payload, args.requests, args.concurrency))
        subprocess.run(["callgrind_control", "--dump", str(proxy.pid)], check=True,
                       capture_output=True)
        if failed:
            raise RuntimeError(f"{failed} of {args.requests} requests failed")
    finally:
        proxy.send_signal(signal.SIGTERM)
        try:
            proxy.wait(60)
        except subprocess.TimeoutExpired:
            proxy.kill()
            proxy.wait()
    # The explicit dump holds the counted window; the file written at exit, nothing since.
    dumps = [path for path in glob.glob(os.path.join(out, "counted.*")) if path.endswith(".1")]
    if not dumps:
        raise RuntimeError(f"callgrind wrote no dump in {out}")
    with open(dumps[0]) as dump:
        for line in dump:
            if line.startswith(("summary:", "totals:")):
                total = int(line.split()[1])
                break
        else:
            raise RuntimeError(f"no totals in {dumps[0]}")
    if args.keep:  # for callgrind_annotate: where the counted instructions went
        shutil.copy(dumps[0], args.keep)
    shutil.rmtree(out, ignore_errors=True)
    return total / args.requests / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-protocol", default="relay", choices=("relay", "mooncake"))
    parser.add_argument("--stream", action="store_true", help="streamed chat requests")
    parser.add_argument("--requests", type=int, default=600, help="counted requests")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--loop", default="uvloop")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--keep", metavar="PATH",
                        help="copy the counted window's callgrind profile to PATH "
                             "(callgrind_annotate --inclusive=yes PATH)")
    parser.add_argument("--features", action="store_true",
                        help="the floor, each optional feature on, and as shipped")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench/instructions.py needs valgrind (apt install valgrind)", file=sys.stderr)
        return 2
    extra = dict(item.split("=", 1) for item in args.proxy_env)
    backends = Backends(16, 0.0, "--enable-prompt-tokens-details")
    try:
        if not args.features:
            print(f"{count(backends, extra, args):.1f}k instructions per request "
                  f"({args.kv_protocol}, {'streamed' if args.stream else 'not streamed'}, "
                  f"{args.requests} requests at {args.concurrency} in flight)")
            return 0
        floor = count(backends, {**FLOOR, **extra}, args)
        print("| feature | default | k instructions per request | cost |\n|---|---|---|---|")
        print(f"| {FLOOR_ROW} |  | {floor:.0f} |  |")
        for name, on, default in [*FEATURES, (DEFAULTS_ROW, None, None)]:
            if on is not None and on.get("PD_PROXY_OTEL") == "1":
                continue  # spans need the OpenTelemetry SDK, not in the bench's set-up
            figure = count(backends, {**(FLOOR if on is not None else {}), **(on or {}),
                                      **extra}, args)
            shown = {True: "on", False: "off", None: ""}[default]
            print(f"| {name} | {shown} | {figure:.0f} | {figure - floor:+.0f} "
                  f"({(figure - floor) / floor:+.1%}) |", flush=True)
    finally:
        backends.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
