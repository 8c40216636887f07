"""The prefix traces replayed offline through CacheRouter, in one process, in seconds.

``python bench/load_replay.py`` runs the traces of load_trace.py (seeds with
``--seeds``) through 1 or 2 CacheRouter replicas taking turns, to emulated
prefills (the demo's block prefix cache, one request at a time each, 15 µs per
uncached token plus a fixed 1.5 ms a leg) at 16 in flight, with the engines'
queues reported to every replica each second and to the sender on each answer
(as ORCA does). No sockets and no timing noise: the same seed gives the same
figures, so a routing change can be judged on many seeds before bench/load.py
measures it on real processes (where the ports, so the rendezvous orders, and
the timing differ each run). Figures: hit rate minus the one-big-cache
reference's, spread (max / mean prefill legs), wall time of the emulation.

``--share-index`` and ``--share-placement`` give the replicas one PrefixIndex
or one Placement: what the replicas' disagreement on each costs.
``--share-all`` gives them one of everything a choice reads (the index, the
placement, the queued work and legs, and every engine report at once): an
oracle no deployment has, the most that sharing could buy. ``--peers``
shares as PD_PROXY_PEERS does (routing/peers.py): each replica's prefill
choices reach the other's index at the next flush (every 20 ms), not at once.

``--labels K`` replays each seed over K sets of prefill labels (set 0 is
127.0.0.1:9000 and up, as before; set k has other ports, so other rendezvous
orders): over real sockets the ports, so the orders, differ every run, and a
cell's figure moves with them (bench/load_prefix.py's runs differ by up to 10
points), so a change is judged over several sets, not on the one lucky or
unlucky order of set 0.

``--why`` (two replicas): before each choice, a copy of the other replica
chooses for the same request, and where the two differ the cause is counted:
their placements of the group differ (both placed it, apart, or only one did),
their homes differ under one placement (each follows what it itself sent), or
one spilled by its own counts. On the code issue 22 left (five seeds), the
replicas are apart on 10-12% of chat's requests and 21-31% of few-shot's and
mix's, in roughly equal parts placement, home and spill; half to 70% of the
requests come before their group is placed at all (each replica routes about
110 per trace and places every 32).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import heapq
import itertools
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load_trace import prompt_tokens, reference_hit_rate, trace  # noqa: E402

from lowproxy.config import Config, parse_endpoint  # noqa: E402
from lowproxy.demo.kv import PrefixCache  # noqa: E402
from lowproxy.routing.cache_router import CacheRouter  # noqa: E402

US_PER_TOKEN = 15e-6
LEG_SECONDS = 0.0015  # what a prefill leg costs beyond its tokens
DECODE_SECONDS = 0.004
BLOCKS = 700  # per emulated prefill, as bench/load_prefix.py
IN_FLIGHT = 16
REPORT_SECONDS = 1.0  # /metrics read by every replica


class Reports:
    """What the engines reported, as a replica's EngineLoads answers it."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], float] = {}

    def get(self, endpoint: Any, field: str) -> float | None:
        return self.values.get((endpoint.label, field))


FLUSH_SECONDS = 0.02  # routing/peers.py


def replay(name: str, prefills: int, replicas: int, seed: int, share_index: bool = False,
           share_placement: bool = False, peers: bool = False, flush: float = FLUSH_SECONDS,
           why: collections.Counter | None = None, share_all: bool = False,
           labels: int = 0) -> tuple[float, float, float, float]:
    """(hit rate, spread, wall seconds, the one-big-cache reference's hit rate);
    ``why``: counts of what the two replicas disagree on (``--why``)."""
    conversations = trace(name, seed)
    config = dataclasses.replace(Config(), prefix_cache_tokens=BLOCKS * 16)
    endpoints = [parse_endpoint(f"http://127.0.0.1:{port}") for port in ports(labels, prefills)]
    if peers:  # the keys every process computes alike, as with PD_PROXY_PEERS
        config = dataclasses.replace(config, peers=(parse_endpoint("http://127.0.0.1:1"),))
    routers = [CacheRouter(config, Reports()) for _ in range(replicas)]  # type: ignore[arg-type]
    outboxes: list[list[tuple[str, list[int]]]] = [[] for _ in routers]
    for router, outbox in zip(routers, outboxes, strict=True):
        if peers:
            router.shared = lambda label, chain, outbox=outbox: outbox.append((label, chain))
    for router in routers:
        router.prune("prefill", endpoints)
        if share_index or share_all:
            router.prefills = routers[0].prefills
        if share_placement or share_all:
            router.placement = routers[0].placement
        if share_all:
            router.queued, router.legs = routers[0].queued, routers[0].legs
            router.engine = routers[0].engine
    caches = [PrefixCache(16, BLOCKS) for _ in endpoints]
    queues: list[collections.deque] = [collections.deque() for _ in endpoints]
    busy = [False] * prefills
    legs = [0] * prefills
    ready = collections.deque((conversation, 0) for conversation in conversations)
    sent: list[tuple[str, bytes]] = []
    events: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    cached_total = prompt_total = 0
    idle, now, last = IN_FLIGHT, 0.0, 0.0

    def report(router: CacheRouter, index: int) -> None:
        router.engine.values[(endpoints[index].label, "waiting")] = float(len(queues[index]))  # type: ignore[union-attr]

    def serve(index: int) -> None:
        nonlocal cached_total, prompt_total
        if busy[index] or not queues[index]:
            return
        job = queues[index].popleft()
        tokens = job[4]
        cached = caches[index].lookup(tokens)
        caches[index].insert(tokens)
        cached_total += cached
        prompt_total += len(tokens)
        busy[index] = True
        seconds = LEG_SECONDS + (len(tokens) - cached) * US_PER_TOKEN
        heapq.heappush(events, (now + seconds, next(order), "done", (index, job)))

    def start() -> None:
        nonlocal idle
        while idle and ready:
            conversation, turn = ready.popleft()
            idle -= 1
            body = conversation.bodies[turn]
            router = routers[len(sent) % replicas]
            sent.append((conversation.path, body))
            surface = "chat" if conversation.path.endswith("/chat/completions") else "completions"
            blocks = router.blocks(surface, json.loads(body))
            other = None
            if why is not None and replicas == 2 and blocks.chain:
                other = _other_choice(routers[1 - routers.index(router)], endpoints, blocks)
            endpoint, cost, reason = router.choose_prefill(endpoints, blocks)
            if other is not None:
                why["requests"] += 1
                why["unplaced"] += blocks.first not in router.placement.homes
                why["spilled"] += reason == "load"
                why[_disagreement(router, endpoint.label, reason, blocks.first, *other)] += 1
            index = endpoints.index(endpoint)
            legs[index] += 1
            queues[index].append((conversation, turn, router, cost,
                                  prompt_tokens(conversation.path, body)))
            serve(index)

    heapq.heappush(events, (0.0, next(order), "start", None))
    heapq.heappush(events, (REPORT_SECONDS, next(order), "metrics", None))
    if peers:
        heapq.heappush(events, (flush, next(order), "flush", None))
    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "start":
            start()
        elif kind == "metrics":
            for router in routers:
                for index in range(prefills):
                    report(router, index)
            if ready or idle < IN_FLIGHT:
                heapq.heappush(events, (now + REPORT_SECONDS, next(order), "metrics", None))
        elif kind == "flush":  # each replica's batch recorded by the others
            for sender, outbox in enumerate(outboxes):
                for other, router in enumerate(routers):
                    if other != sender:
                        for label, chain in outbox:
                            router.prefills.record(label, chain)
                outbox.clear()
            if ready or idle < IN_FLIGHT:
                heapq.heappush(events, (now + flush, next(order), "flush", None))
        elif kind == "done":
            index, (conversation, turn, router, cost, _) = data
            busy[index] = False
            router.release_prefill(endpoints[index], cost)
            report(router, index)  # ORCA: the answer brings the queue back
            serve(index)
            heapq.heappush(events, (now + DECODE_SECONDS, next(order), "answer",
                                    (conversation, turn)))
        else:
            conversation, turn = data
            idle += 1
            last = now
            if turn + 1 < len(conversation.bodies):
                ready.append((conversation, turn + 1))
            start()
    mean = sum(legs) / len(legs)
    return (cached_total / max(prompt_total, 1), max(legs) / mean, last,
            reference_hit_rate(sent, BLOCKS * prefills))


def ports(labels: int, prefills: int) -> list[int]:
    """The prefill ports of label set ``labels`` (``--labels``): 9000 and up for set 0."""
    return [9000 + 1000 * labels + i * (1 + 6 * labels) for i in range(prefills)]


def _other_choice(other: CacheRouter, endpoints: list, blocks: Any
                  ) -> tuple[str, str, tuple[str, ...]]:
    """What ``other`` would choose for this request, from a copy (its state is left
    alone; the endpoints, the config and the reports are shared, not copied):
    (label, reason, its placed homes of the group)."""
    memo = {id(item): item for item in (*endpoints, other.engine)}
    twin = copy.deepcopy(other, memo)
    endpoint, _, reason = twin.choose_prefill(endpoints, blocks)
    return endpoint.label, reason, twin.placement.homes.get(blocks.first, ())


def _disagreement(router: CacheRouter, label: str, reason: str, first: int,
                  other_label: str, other_reason: str, other_homes: tuple[str, ...]) -> str:
    if label == other_label:
        return "same choice"
    homes = router.placement.homes.get(first, ())
    if homes != other_homes:
        return "placement: both placed, apart" if homes and other_homes \
            else "placement: one placed"
    spilled = (reason == "load") + (other_reason == "load")
    if not spilled:
        return "home: what each sent"
    return "spill: both, elsewhere" if spilled == 2 else "spill: one"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="22,5,7,11,13", help="trace seeds, comma-separated")
    parser.add_argument("--share-index", action="store_true")
    parser.add_argument("--share-placement", action="store_true")
    parser.add_argument("--share-all", action="store_true",
                        help="one of everything a choice reads (an oracle)")
    parser.add_argument("--peers", action="store_true", help="share as PD_PROXY_PEERS does")
    parser.add_argument("--flush", type=float, default=FLUSH_SECONDS,
                        help="--peers: seconds between batches")
    parser.add_argument("--labels", type=int, default=1,
                        help="sets of prefill labels (ports) each seed is replayed over")
    parser.add_argument("--why", action="store_true",
                        help="two replicas: count what they disagree on")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    sets = range(max(1, args.labels))
    print(f"replay: {IN_FLIGHT} in flight, {BLOCKS} blocks per prefill, seeds {args.seeds}"
          f"{f', {len(sets)} label sets' if len(sets) > 1 else ''}; "
          "hit rate minus the reference's (mean, worst), spread (mean), wall s (mean)")
    for name in ("chat", "few-shot", "mix"):
        for prefills in (2, 4):
            line = f"{name:<9}{prefills}"
            why: collections.Counter = collections.Counter()
            for replicas in (1, 2):
                runs = [replay(name, prefills, replicas, seed, args.share_index,
                               args.share_placement, args.peers, args.flush,
                               why if args.why else None, args.share_all, labels)
                        for seed in seeds for labels in sets]
                gaps = [hit - reference for hit, _, _, reference in runs]
                line += (f" | {replicas} replica{'s' if replicas > 1 else ' '}: "
                         f"{statistics.mean(gaps):+6.1%} worst {min(gaps):+6.1%} spread "
                         f"{statistics.mean(run[1] for run in runs):.2f} wall "
                         f"{statistics.mean(run[2] for run in runs):.2f}")
            print(line, flush=True)
            if args.why:
                total = max(1, why.pop("requests", 0))
                context = f"; group not placed {why.pop('unplaced', 0) / total:.0%}, " \
                    f"spilled {why.pop('spilled', 0) / total:.0%}"
                print(f"    two replicas apart on {1 - why.pop('same choice', 0) / total:.0%}: "
                      + ", ".join(f"{cause} {count / total:.1%}" for cause, count in sorted(
                          why.items(), key=lambda item: -item[1])) + context, flush=True)


if __name__ == "__main__":
    main()
