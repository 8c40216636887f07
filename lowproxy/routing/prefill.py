"""Which prefill endpoint a request's prefill leg goes to (PD_PROXY_PREFILL_POLICY).

A scheduler's choice (``x-prefiller-host-port``, llm-d's convention) always
wins when the allow list admits it. Otherwise, among the healthy endpoints
that serve the request's model and are not cooling down:

- ``cache-aware`` (default): the endpoint holding the longest part of the
  prompt, balanced by queued uncached tokens (cache_router.py, cache_aware.py);
  the reason counted is cache (a match took it), cold (nobody held it: placed
  by rendezvous hashing) or load;
- ``affinity``: the request's prefix key (affinity.py) on a hash
  ring of the endpoints' names, with bounded loads, so requests sharing a
  prefix hit one endpoint's prefix cache; requests without a key go by load;
- ``least-loaded``: the fewest outstanding prompt bytes;
- ``round-robin``: in turn, as lowproxy did before.

Load is outstanding prompt bytes (a 100k-token prompt is not one unit),
counted from the choice until the prefill leg ends: dispatch reports that once
(also when no leg was sent), and the proxy releases the request's lease then. Each choice is
counted in lowproxy_prefill_choice_total by its reason: header, affinity (the
key's home endpoint), load (bounded loads sent the key on, no key, or the
least-loaded policy), only (one usable endpoint: nothing was chosen) or
round-robin.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from ..config.settings import EndpointSpec, split_host_port
from ..observability.metrics import Counter
from ..upstream.endpoint import Endpoint
from ..upstream.pool import Upstream
from .affinity import PromptFacts, Ring, choose_bounded, stable_hash
from .blocks import NO_BLOCKS, PromptBlocks
from .cache_router import CacheRouter
from .groups import HEADER_TARGETS_KEPT, BackendGroup, PrefillTargetAllowList

log = logging.getLogger("lowproxy.routing")

POLICIES = ("cache-aware", "affinity", "least-loaded", "round-robin")


class TargetRefused(Exception):
    """A scheduler-named prefill target that may not be used; ``status`` is the answer."""

    def __init__(self, status: int, message: str, target: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.target = target


class PrefillChooser:
    """Chooses prefill endpoints and keeps their outstanding work.

    A named target that is one of the group's endpoints uses that endpoint (its
    pool, its ``#bootstrap_port``); others get endpoints of their own, kept in
    a bounded LRU so their pools are reused.
    """

    def __init__(self, group: BackendGroup, allow: PrefillTargetAllowList,
                 upstream: Upstream, policy: str = "round-robin", slack: float = 0.25,
                 choices: Counter | None = None, router: CacheRouter | None = None) -> None:
        self.group = group
        self.router = router if policy == "cache-aware" else None
        self.allow = allow
        self._ignored_header_told = False
        self.upstream = upstream
        self.policy = policy
        self.slack = slack
        self.choices = choices
        self.named: OrderedDict[tuple[str, int], Endpoint] = OrderedDict()
        self.outstanding: dict[Endpoint, int] = {}  # prompt bytes chosen, not yet released
        self._ring: Ring | None = None
        self._ring_of: list[Endpoint] | None = None
        self._turn = 0

    def named_target(self, header: bytes | None) -> Endpoint | None:
        """The scheduler-named endpoint; raises TargetRefused for a refused header."""
        if header is None:
            return None
        if not self.allow.enabled:
            if not self._ignored_header_told:  # said once: a scheduler sends it always
                self._ignored_header_told = True
                log.warning("x-prefiller-host-port is ignored: PD_PROXY_PREFILL_HEADER_ALLOW "
                            "is empty (set it to the prefill pods' hosts or CIDRs to honour "
                            "a scheduler's choice)")
            return None
        target = self._named_target(header)
        return self._named_endpoint(target) if target is not None else None

    def lease(self, named: Endpoint | None, facts: PromptFacts,
              model: str | None, blocks: PromptBlocks = NO_BLOCKS) -> PrefillLease:
        return PrefillLease(self, named, facts, model, blocks)

    def choose_cached(self, blocks: PromptBlocks, model: str | None
                      ) -> tuple[Endpoint | None, float]:
        """cache-aware: (the endpoint, the uncached tokens queued on it until released)."""
        router = self.router
        assert router is not None
        now = time.monotonic()
        usable = [e for e in self.group.candidates(model) if e.usable(now)]
        if not usable:  # all cooling down or out: try one anyway
            return self._counted(self.group.soonest_usable(model), "load"), 0.0
        router.prune("prefill", self.group.endpoints)
        endpoint, cost, reason = router.choose_prefill(usable, blocks)
        return self.group.count_sent(self._counted(endpoint, reason)), cost

    def choose(self, named: Endpoint | None, facts: PromptFacts,
               model: str | None) -> Endpoint | None:
        """The endpoint for one prefill leg (its load is not counted here)."""
        if named is not None:
            return self.group.count_sent(self._counted(named, "header"))
        group = self.group
        if self.policy == "round-robin":
            endpoint = group.pick_round_robin(model=model)
            if endpoint is not None:
                return self._counted(endpoint, "round-robin")
            return self._counted(group.soonest_usable(model), "round-robin")
        now = time.monotonic()
        usable = [e for e in group.candidates(model) if e.usable(now)]
        if not usable:  # all cooling down or out: try one anyway
            return self._counted(group.soonest_usable(model), "load")
        if len(usable) == 1:  # nothing to choose: neither a prefix nor load decided it
            return group.count_sent(self._counted(usable[0], "only"))
        if self.policy == "affinity" and facts.key is not None and len(usable) > 1:
            endpoint, home = self._by_affinity(usable, facts)
            return group.count_sent(self._counted(endpoint, "affinity" if home else "load"))
        # Ties go in turn: an idle group is not one endpoint's alone.
        self._turn = (self._turn + 1) % len(usable)
        ordered = usable[self._turn:] + usable[:self._turn]
        least = min(ordered, key=lambda e: self.outstanding.get(e, 0))
        return group.count_sent(self._counted(least, "load"))

    def _by_affinity(self, usable: list[Endpoint], facts: PromptFacts
                     ) -> tuple[Endpoint, bool]:
        if self._ring_of is not self.group.endpoints or self._ring is None:
            # Every endpoint of the group is on the ring, usable or not, so one
            # going out (unhealthy, cooling down) moves only its own keys.
            self._ring_of = self.group.endpoints
            self._ring = Ring([endpoint.label for endpoint in self._ring_of])
        by_label = {endpoint.label: endpoint for endpoint in usable}
        loads = {endpoint.label: float(self.outstanding.get(endpoint, 0)) for endpoint in usable}
        assert facts.key is not None
        chosen = choose_bounded(self._ring, stable_hash(facts.key), by_label, loads,
                                float(facts.size or 0), self.slack)
        assert chosen is not None  # usable is not empty
        return by_label[chosen[0]], chosen[1]

    def _counted(self, endpoint: Endpoint | None, reason: str) -> Endpoint | None:
        if endpoint is not None and self.choices is not None:
            self.choices.inc(reason)
        return endpoint

    def _named_target(self, header: bytes) -> tuple[str, int] | None:
        """The first target the header lists, as llm-d's sidecar takes it (without its
        --enable-prefiller-sampling): the scheduler lists its best first. Only that
        one is held to the allow list; ``scheme://host:port`` is read as host:port."""
        for item in header.decode("latin-1").split(","):
            item = item.strip()
            if not item:
                continue
            _, sep, rest = item.partition("://")
            if sep and _.lower() in ("http", "https"):
                item = rest.rstrip("/")
            try:
                host, port = split_host_port(item)
            except ValueError:
                port = None
            if port is None:
                raise TargetRefused(400, "x-prefiller-host-port must be host:port")
            if not self.allow.allows(host, port):
                raise TargetRefused(403, "prefill target not allowed", f"{host}:{port}")
            return host, port
        return None

    def _named_endpoint(self, key: tuple[str, int]) -> Endpoint:
        for configured in self.group.endpoints:
            if (configured.connect_host, configured.port) == key:
                return configured
        endpoint = self.named.get(key)
        if endpoint is not None:
            self.named.move_to_end(key)
            return endpoint
        scheme = self.group.specs[0].scheme if self.group.specs else "http"
        endpoint = Endpoint(EndpointSpec(scheme, key[0], key[1]))
        self.named[key] = endpoint
        while len(self.named) > HEADER_TARGETS_KEPT:
            _, evicted = self.named.popitem(last=False)
            evicted.removed = True
            self.upstream.close_idle(evicted)
        return endpoint


class PrefillLease:
    """One request's prefill choice, made when the planner asks, released (once) when
    dispatch reports its prefill leg ended."""

    __slots__ = ("chooser", "named", "facts", "model", "endpoint", "cost", "blocks", "queued")

    def __init__(self, chooser: PrefillChooser, named: Endpoint | None, facts: PromptFacts,
                 model: str | None, blocks: PromptBlocks = NO_BLOCKS) -> None:
        self.chooser = chooser
        self.named = named
        self.facts = facts
        self.model = model
        self.endpoint: Endpoint | None = None
        self.cost = 0
        self.blocks = blocks
        self.queued = 0.0  # cache-aware: uncached tokens queued on the endpoint

    @property
    def configured(self) -> bool:
        """Whether a prefill leg can be planned at all (a group, or a named target)."""
        return self.named is not None or self.chooser.group.configured

    def __call__(self) -> Endpoint | None:
        if self.named is None and self.chooser.router is not None:
            endpoint, self.queued = self.chooser.choose_cached(self.blocks, self.model)
            self.blocks = NO_BLOCKS  # chosen: the prompt is not kept for the request's life
        else:
            endpoint = self.chooser.choose(self.named, self.facts, self.model)
        if endpoint is not None:
            self.cost = max(1, self.facts.size or 0)
            outstanding = self.chooser.outstanding
            outstanding[endpoint] = outstanding.get(endpoint, 0) + self.cost
            self.endpoint = endpoint
        return endpoint

    def release(self) -> None:
        self.blocks = NO_BLOCKS  # never chosen (a skipped leg): the prompt goes all the same
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is None:
            return
        if self.queued and self.chooser.router is not None:
            self.chooser.router.release_prefill(endpoint, self.queued)
            self.queued = 0.0
        outstanding = self.chooser.outstanding
        left = outstanding.get(endpoint, 0) - self.cost
        if left > 0:
            outstanding[endpoint] = left
        else:
            outstanding.pop(endpoint, None)


__all__ = ["POLICIES", "PrefillChooser", "PrefillLease", "TargetRefused"]
