"""What cache-aware routing costs per request, in process: ``python bench/route_cost.py``.

16 requests in flight (each choice is released 16 choices later), 8 KB chat
prompts from 40 conversations sharing 10 system prompts, 4 prefills and 2
decodes: the prompt's blocks, the prefill choice and its release, the decode
choice and what it served, per request, in µs; beside round robin's choice.
Noisy on a shared machine: CPU time of this process (process_time), the least
of 5 runs, and the ratio to a ``json.loads`` of the same body.

``--peers``: as with PD_PROXY_PEERS set: block keys the same in every process
(crc32, blocks.py), every choice noted for the peers and the batch encoded
every 64 requests (peer_batch.py; the POSTs themselves not counted).

``--unique``: every prompt its own (a number before the system prompt, so no
block is shared): nothing hits, and the indexes drop blocks all the time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import string
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowproxy.config import Config, parse_endpoint  # noqa: E402
from lowproxy.routing.cache_router import CacheRouter  # noqa: E402
from lowproxy.routing.groups import BackendGroup  # noqa: E402
from lowproxy.routing.peer_batch import encode  # noqa: E402

IN_FLIGHT = 16
REQUESTS = 20000
UNIQUE = 4000  # prompts in --unique: the order goes round them, each seen 5 times


def bodies(rng: random.Random, unique: bool) -> list[dict]:
    def words(count: int) -> str:
        return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3))
                        for _ in range(count))
    systems = [words(1900) for _ in range(10)]  # 7.6 KB
    out = []
    # Unique: more prompts than the 4 prefills' indexes hold (2048 blocks each).
    for n in range(UNIQUE if unique else 40):
        out.append({"model": "m", "messages": [
            {"role": "system", "content": f"{n} {systems[n % 10]}" if unique
             else systems[n % 10]},
            {"role": "user", "content": words(60)}]})  # about 8 KB in all
    return out


def main() -> None:
    rng = random.Random(1)
    peers = "--peers" in sys.argv[1:]
    unique = "--unique" in sys.argv[1:]
    config = dataclasses.replace(Config(), peers=(parse_endpoint("http://127.0.0.1:1"),)
                                 if peers else ())
    prefill = BackendGroup("prefill", [parse_endpoint(f"http://127.0.0.1:{9000 + i}")
                                       for i in range(4)])
    decode = BackendGroup("decode", [parse_endpoint(f"http://127.0.0.1:{9100 + i}")
                                     for i in range(2)])
    router = CacheRouter(config)
    outbox: list = []
    if peers:
        router.shared = lambda label, chain: outbox.append((label, chain))
    prompts = bodies(rng, unique)
    order = ([prompts[n % len(prompts)] for n in range(REQUESTS)] if unique
             else [prompts[rng.randrange(len(prompts))] for _ in range(REQUESTS)])

    def cache_aware() -> float:
        pending: deque = deque()
        started = time.process_time()
        for body in order:
            blocks = router.blocks("chat", body)
            endpoint, cost, _ = router.choose_prefill(prefill.endpoints, blocks)
            chosen, _ = router.choose_decode(decode.endpoints, blocks)
            pending.append((endpoint, cost, chosen or decode.endpoints[0], blocks))
            if len(pending) >= IN_FLIGHT:
                done, cost, served, held = pending.popleft()
                router.release_prefill(done, cost)
                router.served_decode(served, held)
            if len(outbox) >= 64:
                encode(1, 2, 512, outbox)
                outbox.clear()
        return (time.process_time() - started) / len(order) * 1e6

    def round_robin() -> float:
        started = time.process_time()
        for _ in order:
            prefill.pick_round_robin()
        return (time.process_time() - started) / len(order) * 1e6

    raw = [json.dumps(body).encode() for body in prompts]

    def parse() -> float:  # the yardstick: what the proxy spends on every body anyway
        started = time.process_time()
        for index in range(len(order)):
            json.loads(raw[index % len(raw)])
        return (time.process_time() - started) / len(order) * 1e6

    cache_aware()  # warm: the indexes filled
    # The least of 5 runs of each: what the code costs, less what other
    # processes on a shared machine took from it.
    runs = [(cache_aware(), round_robin(), parse()) for _ in range(5)]
    figures = tuple(min(run[i] for run in runs) for i in range(3))
    print(f"cache-aware {figures[0]:.1f} µs/request, round robin {figures[1]:.1f} µs, "
          f"json.loads of the body {figures[2]:.1f} µs (cache-aware = "
          f"{figures[0] / figures[2]:.2f} x parsing; {IN_FLIGHT} in flight, 8 KB chat "
          f"prompts, 4 prefills, 2 decodes, {REQUESTS} requests"
          f"{'; unique prompts' if unique else ''}{'; with peers' if peers else ''})")


if __name__ == "__main__":
    main()
