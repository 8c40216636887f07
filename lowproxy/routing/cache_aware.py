"""Cache-aware choice, pure: what was sent where, the longest match, cold placement.

``PrefixIndex`` remembers, per endpoint label, the block hashes of the prompts
sent there (blocks.py), bounded by the endpoint's prefix cache size and
aged as its LRU would: a prompt's blocks are touched first block last, so a
chain ages tail first, as vLLM evicts, and what an endpoint holds of a chain is
always a prefix of it (the longest match is found by bisection).

``choose`` picks, among the usable endpoints, given in an order every replica
computes alike (the prefix group's placed homes, placement.py, then the
rendezvous order of the first block over the endpoint labels, ``ranked``):

1. home: among the placed homes (all endpoints for a group not placed), the
   one holding the longest match; ties, and a prompt nobody holds, go by the
   order, so that replicas agree on cold placements without sharing state,
   and an endpoint leaving moves only the prefixes it held;
2. unless home is overloaded: each endpoint's work is its queued uncached
   tokens (the proxy's own estimate, or what the engine reported, whichever is
   more) plus this request's uncached tokens there; home keeps the request
   while its work stays within (1 + slack) x the least work plus an absolute
   allowance (a handful of requests is no imbalance), and while its prefill
   legs in flight stay under LEG_ROOM x the mean plus one; otherwise the next
   endpoint in the prefix's rendezvous order that is within those bounds takes
   it (and from then on holds that prefix too). Spilling along the rendezvous
   order rather than to the least worked endpoint makes replicas whose load
   counts differ a little spill a prefix to the same place.
"""

from __future__ import annotations

import zlib
from collections import deque
from itertools import islice
from typing import Mapping, NamedTuple, Sequence

_MASK = (1 << 64) - 1
# No endpoint takes more than this many times the mean prefill legs in flight
# (plus one): hits cost little, and a hot prefix would pile on one engine.
LEG_ROOM = 3.0


def mix64(value: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value, the same in every process."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def label_salt(label: str) -> int:
    """A label's rendezvous salt: stable across processes (no per-process hash())."""
    encoded = label.encode()
    return zlib.crc32(encoded) << 32 | zlib.adler32(encoded)


class PrefixIndex:
    """Per label, the blocks sent there, least recently used first, at most
    ``capacity`` (+ a quarter).

    A dict's order is its LRU order: recording a chain pops its blocks and puts
    them back at the end, its tail first, so that a chain ages tail first (a
    prompt's first block is its freshest). Once a quarter more than
    ``capacity`` is held, the oldest are dropped from the front down to
    ``capacity``. A block costs about the same whether its prompt is new or
    seen before, where ordering the blocks by a timestamp and sorting them all
    every quarter over cost unique 8 KB prompts 47 µs a request to route
    (bench/route_cost.py --unique; 30 µs this way; repeated prompts cost the
    same 18 µs either way).
    """

    __slots__ = ("capacity", "held")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.held: dict[str, dict[int, None]] = {}

    def match(self, label: str, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` ``label`` holds."""
        held = self.held.get(label)
        if not held or not chain:
            return 0
        if chain[-1] in held:
            return len(chain)
        if chain[0] not in held:  # a prefix nobody sent here: no bisection
            return 0
        low, high = 1, len(chain) - 1  # chain[:low] held; chain[high] not
        while low < high:
            middle = (low + high + 1) // 2
            if chain[middle - 1] in held:
                low = middle
            else:
                high = middle - 1
        return low

    def record(self, label: str, chain: Sequence[int]) -> None:
        """``chain`` was sent to ``label``: its blocks are the freshest, its first most."""
        held = self.held.get(label)
        if held is None:
            held = self.held[label] = {}
        # Popping what is held moves it to the end when put back (setting alone
        # keeps a key where it was); tail first, so the head ends freshest. One
        # pop and one store per block: 0.9 µs for 16, where popping them all
        # and then one update took 1.6, and a drained map 2.1.
        pop = held.pop
        for block in reversed(chain):
            held[block] = pop(block, None)
        excess = len(held) - self.capacity
        if excess > self.capacity >> 2:
            # A deque of no length runs the map in C: hundreds of blocks at once.
            deque(map(held.__delitem__, list(islice(held, excess))), maxlen=0)

    def forget(self, label: str) -> None:
        self.held.pop(label, None)

    def labels(self) -> list[str]:
        return list(self.held)


class Choice(NamedTuple):
    label: str
    matched: int  # blocks of the prompt the chosen endpoint holds
    home: bool    # False: load sent it away from home


def ranked(labels: Sequence[str], salts: Mapping[str, int], first: int) -> list[str]:
    """``labels`` by rendezvous score for ``first`` (a block hash), best first: the
    same order in every replica, so that replicas spill to the same place."""
    return sorted(labels, key=lambda label: mix64(salts[label] ^ first), reverse=True)


def rendezvous(labels: Sequence[str], salts: Mapping[str, int], first: int) -> str:
    """The label winning ``first`` (a block hash): highest mixed score."""
    return max(labels, key=lambda label: mix64(salts[label] ^ first))


def choose(order: Sequence[str], index: PrefixIndex, chain: Sequence[int], tokens: int,
           block_tokens: int, work: Mapping[str, float], slack: float, allowance: float,
           legs: Mapping[str, int] | None = None, pinned: int = 0) -> Choice:
    """The endpoint for a prompt (see the module's docstring).

    ``order``: the usable labels, the prompt's placed homes first (placement.py),
    then the rest in the rendezvous order of its first block (``ranked``); not
    empty. ``pinned``: home is the longest match among the first ``pinned``
    (the placed homes), 0: among all. ``work``: by label, of these labels only
    (one missing counts 0). Issue 22 budgets 15 µs for the whole routing of a
    request, so the others are looked at only when home is not clearly within
    the bound.
    """
    match, get = index.match, work.get
    count = len(order)
    cap = LEG_ROOM * (sum(legs.values()) + 1) / count + 1 if legs else 0.0
    candidates = pinned or count
    whole = len(chain)
    # Home first: the longest match among the candidates, ties by order (a whole
    # match ends the search: none after it holds more).
    home, longest = order[0], -1
    for label in (order if candidates >= count else order[:candidates]):
        matched = match(label, chain)
        if matched > longest:
            home, longest = label, matched
            if matched == whole:
                break
    # Kept without looking at the others when it is within the bound even were
    # every other endpoint's match whole (the least work any could have): the
    # common case, and the same answer as the full comparison below.
    if not legs or legs.get(home, 0) + 1 <= cap:
        lowest = min(work.values()) if len(work) == count else \
            min(get(label, 0.0) for label in order)
        floor = max(1, tokens - whole * block_tokens)
        if get(home, 0.0) + max(1, tokens - longest * block_tokens) \
                <= (1.0 + slack) * (lowest + floor) + allowance:
            return Choice(home, longest, True)
    home, longest, least = order[0], -1, float("inf")
    rows = []
    for position, label in enumerate(order):
        matched = match(label, chain)
        total = get(label, 0.0) + max(1, tokens - matched * block_tokens)
        # Legs in flight are bounded too, as in bounded-load hashing: a hot prefix
        # whose hits cost little would otherwise pile every request on one engine.
        fits = not legs or legs.get(label, 0) + 1 <= cap
        rows.append((label, matched, total, fits))
        # Ties by order too, not by load: replicas then agree on which copy of
        # a spilled prefix to follow, and the other copy ages out.
        if position < candidates and matched > longest:
            home, longest, home_row = label, matched, rows[-1]
        if fits and total < least:
            least = total
    if least == float("inf"):  # none fits the legs bound: by work alone
        rows = [(label, matched, total, True) for label, matched, total, _ in rows]
        least = min(row[2] for row in rows)
        home_row = next(row for row in rows if row[0] == home)
    bound = (1.0 + slack) * least + allowance
    if home_row[3] and home_row[2] <= bound:
        return Choice(home, longest, True)
    # Spill along the order, not to the least loaded: replicas whose loads
    # differ a little still send a prefix's overflow to the same endpoint.
    label, matched, _, _ = next(row for row in rows if row[3] and row[2] <= bound)
    return Choice(label, matched, False)


__all__ = ["Choice", "PrefixIndex", "choose", "label_salt", "mix64", "ranked", "rendezvous"]
