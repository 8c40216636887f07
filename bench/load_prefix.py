"""The ``prefix`` scenario of bench/load.py: prefix-cache hits, load spread, wall time.

The seeded traces of load_trace.py (multi-tenant chat, few-shot completions,
a mix with a hot tenant) go at 16 in flight through the proxy to 2 or 4
emulated prefills and 2 decodes, each a process of its own with a bounded
block prefix cache (16-token blocks, chained hashes, LRU) and a compute time
per uncached prompt token (``--prefill-us-per-token``, one request at a time
per process). With 2 proxy replicas, requests take turns between them (a
conversation's turns alternate). Every cell runs on fresh backends.

Figures per cell, read from the prefills' own /metrics: hit rate (cached
prompt tokens / prompt tokens over all prefill legs), spread (max / mean
prefill legs per endpoint) and the trace's wall time; beside round robin and
the one-big-cache reference (one cache of the summed size, fed the prompts in
the order the first run of the cell sent them). The decode-first rows run the
chat trace with PD_PROXY_DECODE_FIRST_TOKENS set: the share of turns served
without a prefill leg and the prefill tokens saved. ``--peers``: 2 cache-aware
replicas are each other's PD_PROXY_PEERS (they tell each other their prefill
choices), to set beside the same cells without. ``--workers N``: each proxy
runs N workers (the connections, so the turns, land on whichever accepts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from common import ROOT, free_port
from load_procs import child_env
from load_trace import Conversation, prompt_tokens, reference_hit_rate, trace

TRACES = ("chat", "few-shot", "mix")
PREFILLS = (2, 4)
REPLICAS = (1, 2)
CACHE_BLOCKS = 700  # per prefill: 2 hold a little more than the 20 system prompts
# What the proxy is told of each prefill's cache (vLLM logs its size at start).
CACHE_TOKENS = {"PD_PROXY_PREFIX_CACHE_TOKENS": str(CACHE_BLOCKS * 16)}
ROUTERS = (("cache-aware", {"PD_PROXY_PREFILL_POLICY": "cache-aware", **CACHE_TOKENS}),
           ("round-robin", {"PD_PROXY_PREFILL_POLICY": "round-robin"}))
DECODE_FIRST = ("decode-first", {"PD_PROXY_PREFILL_POLICY": "cache-aware", **CACHE_TOKENS,
                                 "PD_PROXY_DECODE_FIRST_TOKENS": "256"})
US_PER_TOKEN = "15"
CONCURRENCY = 16
DECODES = 2


def start(role: str, *extra: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowproxy.demo", "--role", role, "--port", "0",
         "--enable-prompt-tokens-details", "--prefill-us-per-token", US_PER_TOKEN,
         "--max-model-len", "65536", *extra],
        env=child_env({}), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"lowproxy.demo --role {role} exited {proc.wait()}")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int,
              path: str, body: bytes) -> dict[str, Any]:
    writer.write(b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (path.encode(), port, len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    answer = json.loads(await reader.readexactly(length))
    if status != 200:
        raise RuntimeError(f"answer {status}: {answer}")
    return answer


async def drive(ports: list[int], conversations: list[Conversation]
                ) -> list[tuple[str, bytes]]:
    """Every request, CONCURRENCY at a time, proxies in turn; the order they were sent."""
    ready: asyncio.Queue[tuple[Conversation, int]] = asyncio.Queue()
    for conversation in conversations:
        ready.put_nowait((conversation, 0))
    sent: list[tuple[str, bytes]] = []
    active = [0]

    async def slot() -> None:
        links = [await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
                 for port in ports]
        try:
            while True:
                if ready.empty():
                    if not active[0]:
                        return
                    await asyncio.sleep(0.002)  # a turn may follow an answer still due
                    continue
                conversation, turn = ready.get_nowait()
                active[0] += 1
                index = len(sent) % len(ports)
                body = conversation.bodies[turn]
                sent.append((conversation.path, body))
                reader, writer = links[index]
                await one(reader, writer, ports[index], conversation.path, body)
                active[0] -= 1
                if turn + 1 < len(conversation.bodies):
                    ready.put_nowait((conversation, turn + 1))
        finally:
            for _, writer in links:
                writer.close()

    await asyncio.gather(*(slot() for _ in range(CONCURRENCY)))
    return sent


async def _get(port: int, target: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % target.encode())
    data = await reader.read()
    writer.close()
    return data.split(b"\r\n\r\n", 1)[1].decode()


def engine_counters(port: int) -> dict[str, float]:
    text = asyncio.run(_get(port, "/metrics"))
    return {line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("vllm:")}


def proxy_counts(port: int) -> tuple[float, dict[str, float]]:
    """(prefill legs skipped as decode-cached, prefill choices by reason) of one proxy."""
    text = asyncio.run(_get(port, "/metrics"))
    lines = text.splitlines()
    skipped = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                  if line.startswith("lowproxy_prefill_legs_total{")
                  and 'reason="decode-cached"' in line)
    choices = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("lowproxy_prefill_choice_total{")}
    return skipped, choices


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            asyncio.run(asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("proxy did not start") from None
            time.sleep(0.05)


def run_cell(router: tuple[str, dict[str, str]], name: str, prefills: int, replicas: int,
             command: list[str], peers: bool = False) -> dict[str, Any]:
    conversations = trace(name)
    decodes = [start("decode") for _ in range(DECODES)]
    backends = [start("prefill", "--bootstrap-port", "0", "--prefix-cache-blocks",
                      str(CACHE_BLOCKS)) for _ in range(prefills)]
    ports = [free_port() for _ in range(replicas)]
    proxies = []
    peers = peers and replicas > 1 and router[1].get("PD_PROXY_PREFILL_POLICY") == "cache-aware"
    try:
        for port in ports:
            shared = {"PD_PROXY_PEERS": ",".join(f"http://127.0.0.1:{other}" for other in ports
                                                 if other != port)} if peers else {}
            env = child_env({
                "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(port),
                "PD_PROXY_PREFILL_URL": ",".join(
                    f"{info['prefill']}#bootstrap_port={info['bootstrap_port']}"
                    for _, info in backends),
                "PD_PROXY_DECODE_URL": ",".join(info["decode"] for _, info in decodes),
                "PD_PROXY_LOG_LEVEL": "warning", "PD_PROXY_HEALTH_INTERVAL_SECONDS": "1",
                **router[1], **shared})
            proxies.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, cwd=ROOT))
        for port in ports:
            wait_listening(port)
        started = time.perf_counter()
        sent = asyncio.run(drive(ports, conversations))
        wall = time.perf_counter() - started
        counters = [engine_counters(int(info["prefill"].rsplit(":", 1)[1]))
                    for _, info in backends]
        legs = [c["vllm:request_success_total"] for c in counters]
        hits = sum(c["vllm:prefix_cache_hits_total"] for c in counters)
        queries = sum(c["vllm:prefix_cache_queries_total"] for c in counters)
        counts = [proxy_counts(port) for port in ports]
        saved = sum(skipped for skipped, _ in counts)
        choices: dict[str, float] = {}
        for _, by_reason in counts:
            for reason, count in by_reason.items():
                choices[reason] = choices.get(reason, 0.0) + count
        total = sum(len(prompt_tokens(path, body)) for path, body in sent)
        return {"router": router[0], "trace": name, "prefills": prefills,
                "replicas": replicas, "peers": peers, "requests": len(sent), "sent": sent,
                "hit_rate": hits / max(queries, 1),
                "spread": max(legs) / (sum(legs) / len(legs)) if sum(legs) else float("nan"),
                "wall": wall, "decode_first": saved / max(len(sent), 1), "choices": choices,
                "tokens_saved": 1 - queries / max(total, 1)}
    finally:
        for proxy in proxies:
            stop(proxy)
        for proc, _ in backends + decodes:
            stop(proc)


def run(command: list[str], traces: tuple[str, ...] = TRACES,
        prefills_of: tuple[int, ...] = PREFILLS, replicas_of: tuple[int, ...] = REPLICAS,
        routers: tuple[str, ...] = ("cache-aware", "round-robin"),
        decode_first: bool = True, peers: bool = False) -> list[dict[str, Any]]:
    rows = []
    for name in traces:
        for prefills in prefills_of:
            first = None
            for router in ROUTERS:
                if router[0] not in routers:
                    continue
                for replicas in replicas_of:
                    row = run_cell(router, name, prefills, replicas, command, peers)
                    first = first or row
                    rows.append(row)
            if first is not None:
                rows.append({"router": "one big cache", "trace": name, "prefills": prefills,
                             "replicas": None, "hit_rate": reference_hit_rate(
                                 first["sent"], CACHE_BLOCKS * prefills),
                             "spread": None, "wall": None})
    if decode_first:
        for replicas in replicas_of:
            rows.append(run_cell(DECODE_FIRST, "chat", 2, replicas, command, peers))
    for row in rows:
        row.pop("sent", None)
    return rows


def medians(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per cell, each figure the median of the runs (the rows line up)."""
    out = []
    for cells in zip(*runs, strict=True):
        row = dict(cells[0])
        for key in ("hit_rate", "spread", "wall", "decode_first", "tokens_saved"):
            values = sorted(cell[key] for cell in cells if cell.get(key) is not None)
            if values:
                row[key] = values[len(values) // 2] if len(values) % 2 else \
                    (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
        out.append(row)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README's table: per trace and prefills, cache-aware beside round robin."""
    def cell(trace_name: str, prefills: int, router: str, replicas: int | None,
             key: str, form: str) -> str:
        for r in rows:
            if (r["trace"], r["prefills"], r["router"], r["replicas"]) == \
                    (trace_name, prefills, router, replicas) and r.get(key) is not None:
                return format(r[key], form)
        return "–"
    lines = ["| trace, prefills | one big cache | cache-aware, 1 / 2 replicas | "
             "round robin, 1 / 2 | spread, cache-aware 1 / 2 | wall, cache-aware 1 / 2 | "
             "wall, round robin 1 / 2 |", "|---|---|---|---|---|---|---|"]
    for name in TRACES:
        for prefills in PREFILLS:
            if not any(r["trace"] == name and r["prefills"] == prefills for r in rows):
                continue
            both = [(router, key, form) for router, key, form in (
                ("cache-aware", "hit_rate", ".1%"), ("round-robin", "hit_rate", ".1%"),
                ("cache-aware", "spread", ".2f"), ("cache-aware", "wall", ".2f"),
                ("round-robin", "wall", ".2f"))]
            figures = [" / ".join(cell(name, prefills, router, n, key, form)
                                  for n in REPLICAS) for router, key, form in both]
            lines.append(f"| {name}, {prefills} | "
                         f"{cell(name, prefills, 'one big cache', None, 'hit_rate', '.1%')} | "
                         + " | ".join(figures) + " |")
    return "\n".join(lines)


def render(rows: list[dict[str, Any]]) -> str:
    lines = [f"prefix: {CONCURRENCY} in flight, {DECODES} decodes, {CACHE_BLOCKS} cache blocks "
             f"of 16 tokens per prefill, {US_PER_TOKEN} µs per uncached token",
             f"{'trace':<10}{'prefills':>9}{'router':>15}{'replicas':>9}{'hit rate':>10}"
             f"{'spread':>8}{'wall s':>8}{'no-prefill':>11}{'saved':>7}"]
    for r in rows:
        spread = "" if r.get("spread") is None else f"{r['spread']:.2f}"
        wall = "" if r.get("wall") is None else f"{r['wall']:.2f}"
        replicas = "" if r.get("replicas") is None else \
            f"{r['replicas']}{'+p' if r.get('peers') else ''}"
        skip = "" if r["router"] != "decode-first" else f"{r['decode_first']:.0%}"
        saved = "" if r["router"] != "decode-first" else f"{r['tokens_saved']:.0%}"
        lines.append(f"{r['trace']:<10}{r['prefills']:>9}{r['router']:>15}{replicas:>9}"
                     f"{r['hit_rate']:>10.1%}{spread:>8}{wall:>8}{skip:>11}{saved:>7}")
    return "\n".join(lines)


def main() -> None:
    """Single cells while iterating, and the README's table (medians of --repeat runs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", choices=TRACES)
    parser.add_argument("--prefills", action="append", type=int, choices=PREFILLS)
    parser.add_argument("--replicas", action="append", type=int, choices=REPLICAS)
    parser.add_argument("--router", action="append", choices=("cache-aware", "round-robin"))
    parser.add_argument("--no-decode-first", action="store_true")
    parser.add_argument("--peers", action="store_true",
                        help="2 cache-aware replicas are each other's PD_PROXY_PEERS")
    parser.add_argument("--workers", type=int, default=1, help="workers per proxy")
    parser.add_argument("--repeat", type=int, default=1, help="medians of this many runs")
    parser.add_argument("--markdown", action="store_true", help="also the README's table")
    parser.add_argument("--choices", action="store_true", help="also the choice reasons")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeat):
        command = [sys.executable, "-m", "lowproxy",
                   *(["--workers", str(args.workers)] if args.workers > 1 else [])]
        runs.append(run(command, tuple(args.trace or TRACES),
                        tuple(args.prefills or PREFILLS), tuple(args.replicas or REPLICAS),
                        tuple(args.router or ("cache-aware", "round-robin")),
                        not args.no_decode_first, args.peers))
        if args.repeat > 1:
            print(render(runs[-1]), file=sys.stderr, flush=True)
    rows = medians(runs)
    print(render(rows))
    if args.choices:
        for r in rows:
            if r.get("choices"):
                print(r["trace"], r["prefills"], r["router"], r["replicas"], r["choices"])
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
