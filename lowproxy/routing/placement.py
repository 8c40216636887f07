"""Where each busy prefix group lives, the same in every replica: bounded loads over
the groups' shares of recent requests.

A prefix group is the prompt's first block (a system prompt, a few-shot
prefix). Rendezvous hashing alone places too few groups to balance: ten groups
on four endpoints often put four on one. Each replica counts the requests of
each group it routes (decayed, the busiest ``kept`` groups) and, every
``every`` requests, assigns the groups afresh: in the order of their hashes
(not of their counts, so that two replicas whose counts differ a little still
walk alike), each group takes the first endpoint of its rendezvous order whose
assigned share stays within (1 + slack) x the mean; a group above that share
alone is spread over as many endpoints as it needs. Replicas taking turns see
like samples of one stream of requests, so they assign (nearly) alike, and a
group moves to another endpoint wholesale rather than request by request.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Callable, Mapping, Sequence


class Placement:
    __slots__ = ("every", "decay", "kept", "placed", "counts", "homes", "seen")

    def __init__(self, every: int = 32, decay: float = 0.9, kept: int = 256,
                 placed: int = 32) -> None:
        self.every, self.decay, self.kept, self.placed = every, decay, kept, placed
        self.counts: dict[int, float] = {}
        self.homes: dict[int, tuple[str, ...]] = {}
        self.seen = 0

    def observe(self, group: int) -> None:
        self.counts[group] = self.counts.get(group, 0.0) + 1.0
        self.seen += 1

    def due(self) -> bool:
        return self.seen >= self.every

    def assign(self, labels: Sequence[str], order: Callable[[int], Sequence[str]],
               slack: float) -> None:
        """Assign every counted group (``order``: its rendezvous order of ``labels``)."""
        self.seen = 0
        counts = self.counts
        total = sum(counts.values())
        # Only the busiest groups are placed (the rest follow their rendezvous
        # order): this runs every ``every`` requests and must stay cheap.
        busiest = sorted(counts.items(), key=itemgetter(1))[-self.placed:]
        if not labels or total <= 0:
            self.homes = {}
            return
        cap = (1.0 + slack) * total / len(labels)
        load: dict[str, float] = dict.fromkeys(labels, 0.0)
        homes: dict[int, tuple[str, ...]] = {}
        for group, weight in sorted(busiest):
            ranked = [label for label in order(group) if label in load]
            if not ranked:
                continue
            parts = min(len(ranked), max(1, -int(-weight // cap)))
            share = weight / parts
            chosen = [label for label in ranked if load[label] + share <= cap][:parts]
            for label in ranked:
                if len(chosen) >= parts:
                    break
                if label not in chosen:
                    chosen.append(label)
            if len(chosen) == 1 and load[chosen[0]] + share > cap:
                chosen = [min(ranked, key=lambda label: load[label])]
            for label in chosen:
                load[label] += share
            homes[group] = tuple(chosen)
        self.homes = homes
        decay = self.decay
        kept = {group: count * decay for group, count in counts.items() if count * decay >= 0.25}
        if len(kept) > self.kept:
            kept = dict(sorted(kept.items(), key=itemgetter(1))[-self.kept:])
        self.counts = kept

    def home(self, group: int, conversation: int, salts: Mapping[str, int]) -> tuple[str, ...]:
        return self.homes.get(group, ())


__all__ = ["Placement"]
