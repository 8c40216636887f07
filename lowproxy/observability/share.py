"""Cross-worker metrics: each worker's snapshot in a file of a per-server directory.

The parent creates the directory before forking and removes it at exit. Each
worker writes its snapshot to ``w<seq>.json`` (``seq`` counts the parent's
forks, so a restarted worker never reuses a name) every second and before it
answers a scrape, by write-and-rename so a reader never sees half a file. A
scrape sums its own live values with every other file. When a worker dies
the parent drops a ``w<seq>.dead`` marker next to its last file: its counters
and histograms keep counting (a restart must not make a counter go down),
its gauges no longer do. Counts a worker made in the second before it died
and had not written yet are lost; none that a scrape has shown are, since a
worker writes its file before answering.
"""

from __future__ import annotations

import json
import os
from typing import Any

Snapshot = dict


class MetricsShare:
    def __init__(self, directory: str, seq: int) -> None:
        self.directory = directory
        self.name = f"w{seq}"

    def write(self, snapshot: Snapshot) -> None:
        path = os.path.join(self.directory, self.name + ".json")
        staging = path + ".tmp"
        try:
            with open(staging, "w", encoding="utf-8") as file:
                json.dump(snapshot, file, separators=(",", ":"))
            os.replace(staging, path)
        except OSError:  # the directory went away: the parent is exiting
            pass

    def peers(self, own: Snapshot) -> list[tuple[Snapshot, bool]]:
        """Write ``own``, then read every other worker's last snapshot (with liveness)."""
        self.write(own)
        found: list[tuple[Snapshot, bool]] = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return found
        dead = {name[:-5] for name in names if name.endswith(".dead")}
        for name in names:
            if not name.endswith(".json") or name[:-5] == self.name:
                continue
            snapshot = _read(os.path.join(self.directory, name))
            if snapshot is not None:
                found.append((snapshot, name[:-5] not in dead))
        return found


def mark_dead(directory: str, seq: int) -> None:
    """Called by the parent when worker ``seq`` has exited."""
    try:
        with open(os.path.join(directory, f"w{seq}.dead"), "w"):
            pass
    except OSError:
        pass


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None
