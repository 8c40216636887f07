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

A group not placed yet starts from where it is: the endpoint its last
request went to as home (``settled``), kept while it fits. Moving a group
costs its whole prefix once more on the new endpoint and the conversations it
held there, so the first assignment moves only the groups the bound forces
out (in the offline replay, bench/load_replay.py, this alone took one replica
from 2.1-5.7 points below the one-big-cache reference to 1.4-3.7).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Callable, Sequence

# Requests (decayed) a group needs before it is placed: a count of one or two
# is noise, and replicas would place such a group apart (the others follow
# their rendezvous order, which every replica agrees on anyway).
MIN_COUNT = 4.0


class Placement:
    __slots__ = ("every", "decay", "kept", "placed", "counts", "homes", "seen", "where")

    def __init__(self, every: int = 32, decay: float = 0.9, kept: int = 256,
                 placed: int = 32) -> None:
        self.every, self.decay, self.kept, self.placed = every, decay, kept, placed
        self.counts: dict[int, float] = {}
        self.homes: dict[int, tuple[str, ...]] = {}
        self.seen = 0
        # By group: the endpoint its last request went to as home (not a spill).
        self.where: dict[int, str] = {}

    def observe(self, group: int) -> None:
        self.counts[group] = self.counts.get(group, 0.0) + 1.0
        self.seen += 1

    def settled(self, group: int, label: str) -> None:
        """A request of ``group`` went to ``label`` as its home (a spill does not count:
        the group stays where its home is)."""
        self.where[group] = label

    def due(self) -> bool:
        return self.seen >= self.every

    def assign(self, labels: Sequence[str], order: Callable[[int], Sequence[str]],
               slack: float) -> None:
        """Assign the busiest groups (``order``: a group's rendezvous order of ``labels``).

        Two passes: groups whose homes are all still there keep them while they
        fit (a group does not move for noise in the counts, nor because an
        endpoint it was not on left); then the others, new or displaced, take
        the first endpoints of their order that fit.
        """
        self.seen = 0
        counts = self.counts
        # Only the busiest groups are placed (the rest follow their rendezvous
        # order): this runs every ``every`` requests and must stay cheap.
        busiest = sorted((group, count) for group, count in
                         sorted(counts.items(), key=itemgetter(1))[-self.placed:]
                         if count >= MIN_COUNT)
        total = sum(counts.values())
        if not labels or total <= 0:
            self.homes = {}
            return
        cap = (1.0 + slack) * total / len(labels)
        load: dict[str, float] = dict.fromkeys(labels, 0.0)
        before, homes = self.homes, {}
        later = []
        for group, weight in busiest:
            kept = before.get(group, ()) or ((self.where[group],) if group in self.where else ())
            share = weight / max(1, len(kept))
            # Kept while it still needs as many endpoints, and they are all there.
            if kept and len(kept) == min(len(labels), max(1, -int(-weight // cap))) \
                    and all(label in load and load[label] + share <= cap for label in kept):
                for label in kept:
                    load[label] += share
                homes[group] = kept
            else:
                later.append((group, weight))
        for group, weight in later:
            ranked = [label for label in order(group) if label in load]
            if not ranked:
                continue
            parts = min(len(ranked), max(1, -int(-weight // cap)))
            share = weight / parts
            chosen = [label for label in ranked if load[label] + share <= cap][:parts]
            if len(chosen) < parts:  # nowhere within the bound: the least loaded
                rest = sorted((label for label in ranked if label not in chosen),
                              key=lambda label: load[label])
                chosen += rest[:parts - len(chosen)]
            for label in chosen:
                load[label] += share
            homes[group] = tuple(chosen)
        self.homes = homes
        decay = self.decay
        decayed = {group: count * decay for group, count in counts.items()
                   if count * decay >= 0.25}
        if len(decayed) > self.kept:
            decayed = dict(sorted(decayed.items(), key=itemgetter(1))[-self.kept:])
        self.counts = decayed
        # Only counted groups can be placed: the others' homes need not be kept.
        self.where = {group: label for group, label in self.where.items() if group in decayed}


__all__ = ["Placement"]
