"""Cache-aware routing's running state: the indexes, the queued work, decode-first.

One CacheRouter per proxy (per worker) owns what cache_aware.py's pure choice
reads: a PrefixIndex of what was sent to each prefill and one of what each
decode served, the Placement of the busiest prefix groups (placement.py),
the uncached tokens queued on each prefill (added at the choice, released
when the prefill leg ends) and the engines' own reports
(engine_load.py). Settings: PD_PROXY_PREFIX_BLOCK_BYTES,
PD_PROXY_PREFIX_CACHE_TOKENS, PD_PROXY_AFFINITY_SLACK,
PD_PROXY_CACHE_ALLOWANCE_TOKENS, PD_PROXY_DECODE_FIRST_TOKENS and
PD_PROXY_DECODE_ALLOWANCE.

Decode-first (llm-d's prefix-based decider): a conversation's next turn goes
to the decode that served the earlier one (its prefix cache holds them) while
that decode has at most PD_PROXY_DECODE_ALLOWANCE requests more than the least
loaded one; when what it does not hold is under PD_PROXY_DECODE_FIRST_TOKENS,
the planner skips the prefill leg (reason ``decode-cached``) and that decode
computes the rest itself.
"""

from __future__ import annotations

from typing import Any, Callable, Container, Iterable, Mapping, Sequence

from ..upstream.endpoint import Endpoint
from .blocks import TOKEN_BYTES, PromptBlocks, prompt_blocks
from .cache_aware import PrefixIndex, choose, label_salt, mix64, ranked
from .engine_load import EngineLoads
from .placement import Placement

KV_FULL = 0.98  # a decode whose KV cache is this full takes no preferred turn
MEAN_COST_START = 512.0  # tokens per prefill leg before any was seen
ORDERS_KEPT = 4096  # rendezvous orders remembered, by first block (a prefix group)


class CacheRouter:
    def __init__(self, config: Any, engine: EngineLoads | None = None) -> None:
        self.block_bytes = config.prefix_block_bytes
        self.block_tokens = max(1, self.block_bytes // TOKEN_BYTES)
        capacity = max(1, config.prefix_cache_tokens // self.block_tokens)
        self.prefills = PrefixIndex(capacity)
        self.decodes = PrefixIndex(capacity)
        self.slack = config.affinity_slack
        self.allowance = float(config.cache_allowance_tokens)
        self.decode_first_tokens = config.decode_first_tokens
        self.decode_allowance = config.decode_allowance
        self.engine = engine
        self.queued: dict[Endpoint, float] = {}  # uncached tokens chosen, leg not ended
        self.legs: dict[str, int] = {}  # prefill legs chosen, not ended, by label
        self.mean_cost = MEAN_COST_START  # of a prefill leg, to weigh an engine's queue
        self._salts: dict[str, int] = {}
        # The rendezvous order of every prefill label, by first block: computing
        # it costs a few µs, and popular prefixes come back all the time.
        self._orders: dict[int, tuple[list[str], list[str]]] = {}
        self._ranks: dict[int, list[str]] = {}  # the rendezvous order alone, by first block
        self.placement = Placement()
        self._ordered: list[str] = []
        self._known: dict[int, tuple[Sequence[Endpoint], set[str]]] = {}
        # PD_PROXY_PEERS (peers.py): keys the same in every replica, and every prefill
        # choice told to the peers (label, chain); None without peers: no cost at all.
        self.stable = bool(getattr(config, "peers", ()))
        self.shared: Callable[[str, list[int]], None] | None = None

    def blocks(self, surface: str, body: Mapping[str, Any]) -> PromptBlocks:
        return prompt_blocks(surface, body, self.block_bytes, self.stable)

    def _salt_of(self, labels: Sequence[str]) -> dict[str, int]:
        salts = self._salts
        for label in labels:
            if label not in salts:
                salts[label] = label_salt(label)
        return salts

    def prune(self, role: str, endpoints: Sequence[Endpoint]) -> None:
        """Forget what was sent to endpoints no longer configured (removed, undiscovered)."""
        index = self.prefills if role == "prefill" else self.decodes
        known = self._known.get(id(index))
        if known is not None and known[0] is endpoints:
            return
        labels = {endpoint.label for endpoint in endpoints}
        if role == "prefill":
            self._ordered = [endpoint.label for endpoint in endpoints]
            self._orders.clear()
            self._ranks.clear()
        for label in index.labels():
            if label not in labels:
                index.forget(label)
        self._known[id(index)] = (endpoints, labels)
        present = set().union(*(known[1] for known in self._known.values()))
        for label in [label for label in self._salts if label not in present]:
            del self._salts[label]  # dns+ churn must not grow this for ever

    # -- prefill

    def _work(self, endpoint: Endpoint) -> float:
        own = self.queued.get(endpoint, 0.0)
        waiting = self.engine.get(endpoint, "waiting") if self.engine is not None else None
        if waiting is None:
            return own
        # The engine's queue holds every replica's requests, ours only ours.
        return max(own, waiting * self.mean_cost)

    def choose_prefill(self, usable: Sequence[Endpoint], blocks: PromptBlocks
                       ) -> tuple[Endpoint, float, str]:
        """(endpoint, its uncached tokens, reason: cache, cold, load, or only); usable not
        empty."""
        if len(usable) == 1:
            return self._only(usable[0], blocks)
        by_label = {endpoint.label: endpoint for endpoint in usable}
        if not self._ordered:  # never pruned (bench/route_cost.py): the usable are all
            self._ordered = list(by_label)
        if self.engine is None:  # the proxy's own counts only (bench/route_cost.py)
            queued = self.queued.get
            work = {label: queued(endpoint, 0.0) for label, endpoint in by_label.items()}
        else:
            work = {label: self._work(endpoint) for label, endpoint in by_label.items()}
        chain, first = blocks.chain, blocks.first
        if chain:
            placement = self.placement
            placement.observe(first)
            if placement.seen >= placement.every:
                before = placement.homes
                placement.assign(self._ordered, self._rendezvous, self.slack)
                after, orders = placement.homes, self._orders
                for group in before.keys() | after.keys():
                    if before.get(group) != after.get(group):
                        orders.pop(group, None)  # placed homes lead its order: they moved
        known = self._orders.get(first)
        if known is not None and len(known[0]) == len(by_label):
            order, pinned = known[0], len(known[1])  # every configured one usable
        else:
            order, pinned = self._order(by_label, first)
        if pinned > 1:
            # A hot group on several endpoints: its conversations split among
            # them by rendezvous of their first turn, alike in every replica
            # (a later turn follows its match anyway).
            parts, opening = order[:pinned], blocks.opening()
            salts = self._salt_of(parts)
            parts.sort(key=lambda label: mix64(salts[label] ^ opening), reverse=True)
            order = parts + order[pinned:]
        label, matched, home = choose(order, self.prefills, chain, blocks.tokens,
                                      self.block_tokens, work, self.slack, self.allowance,
                                      self.legs, pinned)
        endpoint = by_label[label]
        cost = self._count_choice(endpoint, blocks, matched)
        if home and chain:
            self.placement.settled(first, label)
        return endpoint, cost, "load" if not home else "cache" if matched else "cold"

    def _only(self, endpoint: Endpoint, blocks: PromptBlocks) -> tuple[Endpoint, float, str]:
        """One usable prefill: nothing to choose (reason ``only``, as for every policy),
        but what it holds and what it queues are counted as for a choice, so that
        the endpoints that come next are chosen on them."""
        chain = blocks.chain
        matched = self.prefills.match(endpoint.label, chain) if chain else 0
        return endpoint, self._count_choice(endpoint, blocks, matched), "only"

    def _count_choice(self, endpoint: Endpoint, blocks: PromptBlocks, matched: int) -> float:
        """Remember what went to ``endpoint`` and queue its uncached tokens (returned)."""
        label = endpoint.label
        cost = float(max(1, blocks.tokens - matched * self.block_tokens))
        if blocks.chain:
            self.prefills.record(label, blocks.chain)
            if self.shared is not None:
                self.shared(label, blocks.chain)
        self.queued[endpoint] = self.queued.get(endpoint, 0.0) + cost
        self.legs[label] = self.legs.get(label, 0) + 1
        self.mean_cost += (cost - self.mean_cost) / 16.0
        return cost

    def _rendezvous(self, first: int) -> list[str]:
        """The rendezvous order of every configured prefill for ``first`` (kept:
        computing it costs a few µs, and popular prefixes come back all the time)."""
        rank = self._ranks.get(first)
        if rank is None:
            if len(self._ranks) >= ORDERS_KEPT:
                self._ranks.clear()  # a new set of popular prefixes fills it again
            rank = self._ranks[first] = ranked(self._ordered, self._salt_of(self._ordered),
                                               first)
        return rank

    def _order(self, usable: Mapping[str, Endpoint], first: int) -> tuple[list[str], int]:
        """The usable labels, the group's placed homes first, the rest in the
        rendezvous order of ``first`` over every configured prefill (one leaving
        keeps the others' order: it moves only its own prefixes); and how many
        placed homes lead."""
        known = self._orders.get(first)
        if known is None:
            order = self._rendezvous(first)
            placed = [label for label in self.placement.homes.get(first, ()) if label in order]
            known = ([*placed, *(label for label in order if label not in placed)], placed)
            if len(self._orders) >= ORDERS_KEPT:
                self._orders.clear()  # a new set of popular prefixes fills it again
            self._orders[first] = known
        order, placed = known
        # The usable are some of the configured (prune keeps _ordered so).
        if len(usable) == len(order):
            return order, len(placed)
        return [label for label in order if label in usable], \
            sum(1 for label in placed if label in usable)

    def release_prefill(self, endpoint: Endpoint, cost: float) -> None:
        legs = self.legs.get(endpoint.label, 0) - 1
        if legs > 0:
            self.legs[endpoint.label] = legs
        else:
            self.legs.pop(endpoint.label, None)
        left = self.queued.get(endpoint, 0.0) - cost
        if left > 0.5:
            self.queued[endpoint] = left
        else:
            self.queued.pop(endpoint, None)

    # -- decode

    def _decode_load(self, endpoint: Endpoint) -> float:
        own = float(endpoint.in_flight)
        if self.engine is None:
            return own
        running = self.engine.get(endpoint, "running")
        waiting = self.engine.get(endpoint, "waiting")
        if running is None and waiting is None:
            return own
        return max(own, (running or 0.0) + (waiting or 0.0))

    def choose_decode(self, usable: Sequence[Endpoint], blocks: PromptBlocks
                      ) -> tuple[Endpoint | None, int | None]:
        """(the decode holding the longest part of the prompt, the tokens it lacks),
        when its load allows; (None, None): the usual least-loaded pick."""
        if len(usable) < 2:
            return (usable[0], self._lacks(usable[0], blocks)) if usable else (None, None)
        if self.engine is None:  # the proxy's own counts only (bench/route_cost.py)
            loads = {endpoint: float(endpoint.in_flight) for endpoint in usable}
        else:
            loads = {endpoint: self._decode_load(endpoint) for endpoint in usable}
        least = min(loads.values())
        chain = blocks.chain
        if not chain:
            return self._least_reported(usable, loads, least), None
        best, longest, match = None, 0, self.decodes.match
        for endpoint in usable:
            matched = match(endpoint.label, chain)
            if matched > longest or (matched == longest and best is not None
                                     and matched and loads[endpoint] < loads[best]):
                best, longest = endpoint, matched
        usage = self.engine.get(best, "kv_usage") \
            if self.engine is not None and best is not None else None
        if best is None or loads[best] > least + self.decode_allowance \
                or (usage is not None and usage >= KV_FULL):
            return self._least_reported(usable, loads, least), None
        return best, max(0, blocks.tokens - longest * self.block_tokens)

    def _least_reported(self, usable: Sequence[Endpoint], loads: Mapping[Endpoint, float],
                        least: float) -> Endpoint | None:
        """With engines reporting unequal loads, the least loaded; else None (the
        usual pick: fewest requests in flight, ties in turn)."""
        if all(endpoint.in_flight == loads[endpoint] for endpoint in usable):
            return None  # nothing beyond lowproxy's own counts
        return next(endpoint for endpoint in usable if loads[endpoint] == least)

    def _lacks(self, endpoint: Endpoint, blocks: PromptBlocks) -> int | None:
        if not blocks.chain:
            return None
        matched = self.decodes.match(endpoint.label, blocks.chain)
        return max(0, blocks.tokens - matched * self.block_tokens) if matched else None

    def decode_cached(self, lacks: int | None) -> bool:
        """Whether decode may compute the rest itself (the planner adds: not SGLang)."""
        return lacks is not None and lacks < self.decode_first_tokens

    def record_told(self, records: Iterable[tuple[str, Sequence[int]]],
                    known: Container[str]) -> int:
        """Prefill choices another replica (peers.py) or worker (worker_share.py) made,
        recorded as if made here for the labels ``known`` here; how many were."""
        record, recorded = self.prefills.record, 0
        for label, chain in records:
            if label in known:
                record(label, chain)
                recorded += 1
        return recorded

    def served_decode(self, endpoint: Endpoint, blocks: PromptBlocks) -> None:
        if blocks.chain:
            self.decodes.record(endpoint.label, blocks.chain)


__all__ = ["CacheRouter"]
