"""The ``prefix`` scenario of bench/load.py: what prefill affinity buys and costs.

Many conversations, each with its own long system prompt, go through the
proxy to two emulated prefill backends and one decode, once per prefill
policy (affinity, round-robin, least-loaded), on fresh backends each time.
Every prefill keeps a bounded prefix cache (``--prefix-cache-blocks``, per
endpoint) and reports ``usage.prompt_tokens_details.cached_tokens``, which
lowproxy puts in decode's answer (PD_PROXY_REWRITE_CACHED_TOKENS). The cache
is sized so that one copy of every conversation's prefix fits across the two
endpoints but not two copies: round robin keeps each prefix on both and
thrashes, affinity keeps it on one.

Figures per policy: prefix-cache hit rate (cached / prompt tokens), the
prefill load spread (requests per prefill endpoint, max / mean), and the
proxy's CPU per request (µs), beside the same requests sent straight to the
decode (the decode process's CPU per request: the ratio is what the proxy
costs, as in the other scenarios).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from typing import Any

from common import ROOT, free_port
from load_procs import child_env, cpu_delta, cpu_sample

# (row name, PD_PROXY_PREFILL_POLICY, PD_PROXY_AFFINITY_SLACK)
POLICIES = (("affinity", "affinity", "0.25"), ("affinity/1.0", "affinity", "1"),
            ("round-robin", "round-robin", "0.25"), ("least-loaded", "least-loaded", "0.25"))
CONVERSATIONS = 48
TURNS = 6
SYSTEM_WORDS = 480  # demo tokens are whitespace words: 30 blocks of 16
CACHE_BLOCKS = 1100  # per prefill: one copy of half the prefixes fits, of all of them not
CONCURRENCY = 8


def start(role: str, *extra: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowproxy.demo", "--role", role, "--port", "0",
         "--enable-prompt-tokens-details", *extra],
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


def workload(seed: int = 1) -> list[tuple[int, bytes]]:
    """(conversation, body) in the order sent: turns of a conversation in order,
    conversations interleaved."""
    rng = random.Random(seed)
    systems = [" ".join(f"c{c}w{i}" for i in range(SYSTEM_WORDS)) for c in range(CONVERSATIONS)]
    pending = {c: 0 for c in range(CONVERSATIONS)}
    order: list[tuple[int, bytes]] = []
    while pending:
        c = rng.choice(sorted(pending))
        turn = pending[c]
        messages = [{"role": "system", "content": systems[c]}]
        for t in range(turn + 1):
            messages.append({"role": "user", "content": f"question {t} of conversation {c}"})
            if t < turn:
                messages.append({"role": "assistant", "content": f"answer {t}"})
        body = {"model": "demo-model", "messages": messages, "max_tokens": 4}
        order.append((c, json.dumps(body, separators=(",", ":")).encode()))
        pending[c] += 1
        if pending[c] == TURNS:
            del pending[c]
    return order


async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int,
              body: bytes) -> dict[str, Any]:
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (port, len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    answer = json.loads(await reader.readexactly(length))
    if status != 200:
        raise RuntimeError(f"answer {status}: {answer}")
    return answer


async def drive(port: int, order: list[tuple[int, bytes]]) -> tuple[int, int]:
    """Send every request (a conversation's turns one after another); (cached, prompt)."""
    queues: dict[int, list[bytes]] = {}
    for c, body in order:
        queues.setdefault(c, []).append(body)
    ready: asyncio.Queue[int] = asyncio.Queue()
    for c in dict.fromkeys(c for c, _ in order):
        ready.put_nowait(c)
    totals = [0, 0]

    async def slot() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        try:
            while not ready.empty():
                c = ready.get_nowait()
                answer = await one(reader, writer, port, queues[c].pop(0))
                usage = answer.get("usage") or {}
                totals[0] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                totals[1] += usage.get("prompt_tokens", 0)
                if queues[c]:
                    ready.put_nowait(c)  # its next turn, after this answer
        finally:
            writer.close()

    await asyncio.gather(*(slot() for _ in range(CONCURRENCY)))
    return totals[0], totals[1]


def scrape(port: int) -> tuple[float, float]:
    """(max / mean of the requests each prefill endpoint got, share of affinity choices),
    from lowproxy's own metrics."""
    async def get() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = await reader.read()
        writer.close()
        return data
    text = asyncio.run(get()).decode()
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith('lowproxy_endpoint_requests_total{role="prefill"')]
    choices = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lowproxy_prefill_choice_total{")}
    spread = max(counts) / (sum(counts) / len(counts)) if counts else float("nan")
    return spread, choices.get("affinity", 0.0) / max(sum(choices.values()), 1.0)


def run_policy(name: str, policy: str, slack: str, order: list[tuple[int, bytes]],
               command: list[str]) -> dict[str, Any]:
    decode, decode_info = start("decode")
    prefills = [start("prefill", "--bootstrap-port", "0", "--prefix-cache-blocks",
                      str(CACHE_BLOCKS)) for _ in range(2)]
    port = free_port()
    env = child_env({
        "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(port),
        "PD_PROXY_PREFILL_URL": ",".join(
            f"{info['prefill']}#bootstrap_port={info['bootstrap_port']}" for _, info in prefills),
        "PD_PROXY_DECODE_URL": decode_info["decode"], "PD_PROXY_PREFILL_POLICY": policy,
        "PD_PROXY_AFFINITY_SLACK": slack,
        "PD_PROXY_LOG_LEVEL": "warning", "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0"})
    proxy = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                asyncio.run(asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("proxy did not start") from None
                time.sleep(0.05)
        before = cpu_sample(proxy.pid)
        cached, prompt = asyncio.run(drive(port, order))
        user, system = cpu_delta(before, cpu_sample(proxy.pid))
        spread, at_home = scrape(port)
        return {"policy": name, "requests": len(order), "hit_rate": cached / max(prompt, 1),
                "spread": spread, "at_home": at_home,
                "cpu_us": (user + system) / len(order) * 1e6}
    finally:
        stop(proxy)
        for proc, _ in prefills:
            stop(proc)
        stop(decode)


def run_direct(order: list[tuple[int, bytes]]) -> dict[str, Any]:
    """The same requests straight to one decode: its CPU per request, the baseline."""
    decode, info = start("decode")
    try:
        port = int(info["decode"].rsplit(":", 1)[1])
        before = cpu_sample(decode.pid)
        asyncio.run(drive(port, order))
        user, system = cpu_delta(before, cpu_sample(decode.pid))
        return {"policy": "direct", "requests": len(order), "hit_rate": None, "spread": None,
                "at_home": None,
                "cpu_us": (user + system) / len(order) * 1e6}
    finally:
        stop(decode)


def run(command: list[str]) -> list[dict[str, Any]]:
    order = workload()
    rows = [run_policy(*policy, order, command) for policy in POLICIES]
    rows.append(run_direct(order))
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    direct = next(r["cpu_us"] for r in rows if r["policy"] == "direct")
    lines = [f"prefix: {CONVERSATIONS} conversations x {TURNS} turns, {SYSTEM_WORDS}-token "
             f"system prompts, 2 prefills with {CACHE_BLOCKS} cache blocks each, "
             f"concurrency {CONCURRENCY}",
             f"{'policy':<14}{'hit rate':>10}{'spread':>9}{'at home':>9}{'CPU µs/req':>12}"
             f"{'x direct':>10}"]
    for r in rows:
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        spread = "" if r["spread"] is None else f"{r['spread']:.2f}"
        home = "" if r["at_home"] is None else f"{r['at_home']:.0%}"
        lines.append(f"{r['policy']:<14}{hit:>10}{spread:>9}{home:>9}{r['cpu_us']:>12.0f}"
                     f"{r['cpu_us'] / direct:>10.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(run([sys.executable, "-m", "lowproxy"])))
