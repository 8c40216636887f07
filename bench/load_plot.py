"""bench/load.py --plot DIR: the run as PNG charts, for those who would rather look.

- ``latency_cdf.png``: per scenario, the latency distribution of the load sent
  straight to decode and of the same load through the proxy (and through each
  peer: another proxy's saved ``--json-file`` run, given with ``--plot-peer``).
- ``cpu_per_request.png``: per scenario, the proxy's CPU per request beside the
  decode backend's own for the same load (what the proxy adds, against what
  serving costs), and beside each peer's.

Run 1 of each loop is drawn. matplotlib is needed for this only (the ``bench``
extra), never by lowproxy: without it, ``--plot`` stops before any load with
``HINT``. Everything here reads the JSON document load.py prints with --json.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any, Sequence

HINT = ("--plot needs matplotlib (lowproxy itself never does): "
        "pip install 'lowproxy[bench]', or pip install matplotlib")
Document = dict[str, Any]
Series = tuple[str, dict[str, dict[str, Any]]]  # label, scenario -> proxy row
# Scenarios whose latency is a stream held open on purpose: no CDF worth drawing.
NO_CDF = ("idle-streams",)


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def load_peers(paths: list[str]) -> list[Document]:
    documents = []
    for path in paths:
        with open(path) as handle:
            documents.append(json.load(handle))
    return documents


def proxy_label(document: Document) -> str:
    """"lowproxy" for this project's daemon, else the peer's script or program name."""
    command = [str(part) for part in document.get("proxy_cmd") or []]
    if command[-2:] == ["-m", "lowproxy"]:
        return "lowproxy"
    named = [part for part in command if not part.startswith("-")]
    return os.path.basename(named[-1]) if named else "proxy"


def rows(document: Document, target: str, loop: str | None = None) -> dict[str, dict[str, Any]]:
    """Run 1's rows for one target, by scenario (the first loop unless one is named)."""
    results = [r for r in document["results"] if r["target"] == target and r["run"] == 1]
    loops = list(dict.fromkeys(r["loop"] for r in results))
    chosen = loop if loop is not None else (loops[0] if loops else "")
    return {r["scenario"]: r for r in results if r["loop"] == chosen}


def series(documents: list[Document]) -> list[Series]:
    """One series per document and loop: what goes through a proxy."""
    found: list[Series] = []
    for document in documents:
        label = proxy_label(document)
        loops = list(dict.fromkeys(r["loop"] for r in document["results"]
                                   if r["target"] == "proxy" and r["run"] == 1))
        for loop in loops:
            name = f"{label} ({loop})" if len(loops) > 1 else label
            found.append((name, rows(document, "proxy", loop)))
    return found


def plot(document: Document, directory: str, peers: Sequence[Document] = ()) -> list[str]:
    """Write the charts into ``directory`` (created); the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    os.makedirs(directory, exist_ok=True)
    direct = rows(document, "direct")
    drawn = series([document, *peers])
    return [path for path in (latency_cdf(direct, drawn, directory),
                              cpu_per_request(direct, drawn, directory)) if path]


def latency_cdf(direct: dict[str, dict[str, Any]], drawn: list[Series],
                directory: str) -> str | None:
    import matplotlib.pyplot as plt

    scenarios = [s for s in direct if s not in NO_CDF and direct[s].get("latency_cdf_ms")
                 and any(s in by_scenario for _, by_scenario in drawn)]
    if not scenarios:
        return None
    columns = min(3, len(scenarios))
    lines = (len(scenarios) + columns - 1) // columns
    figure, axes = plt.subplots(lines, columns, figsize=(5 * columns, 3.6 * lines),
                                squeeze=False)
    fractions = [q / 100 for q in range(101)]
    for index, scenario in enumerate(scenarios):
        ax = axes[index // columns][index % columns]
        ax.plot(direct[scenario]["latency_cdf_ms"], fractions, label="direct to decode",
                color="black", linestyle="--")
        for name, by_scenario in drawn:
            row = by_scenario.get(scenario)
            if row and row.get("latency_cdf_ms"):
                ax.plot(row["latency_cdf_ms"], fractions, label=f"through {name}")
        ax.set_title(f"{scenario} (c={direct[scenario]['concurrency']})")
        ax.set_xscale("log")
        ax.set_xlabel("latency, ms (log)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    for index in range(len(scenarios), lines * columns):
        axes[index // columns][index % columns].set_visible(False)
    figure.suptitle("Latency CDF: direct to decode vs through the proxy")
    figure.tight_layout()
    return _save(figure, directory, "latency_cdf.png")


def cpu_per_request(direct: dict[str, dict[str, Any]], drawn: list[Series],
                    directory: str) -> str | None:
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(
        s for _, by_scenario in drawn for s, row in by_scenario.items()
        if row.get("cpu_us_per_request") is not None))
    if not scenarios:
        return None
    bars: list[tuple[str, list[float]]] = [
        ("decode backend, direct", [_cpu(direct.get(s)) for s in scenarios])]
    bars += [(name, [_cpu(by_scenario.get(s)) for s in scenarios]) for name, by_scenario in drawn]
    width = 0.8 / len(bars)
    figure, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(scenarios) * len(bars) / 2), 4.2))
    for index, (name, values) in enumerate(bars):
        offsets = [i + (index - (len(bars) - 1) / 2) * width for i in range(len(scenarios))]
        drawn_bars = ax.bar(offsets, values, width, label=name,
                            color="grey" if index == 0 else None)
        ax.bar_label(drawn_bars, labels=[f"{v:.0f}" if v else "" for v in values],
                     fontsize="x-small")
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios)
    ax.set_ylabel("CPU µs per request")
    ax.set_title("CPU per request: each proxy, beside the decode backend's own")
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return _save(figure, directory, "cpu_per_request.png")


def _cpu(row: dict[str, Any] | None) -> float:
    value = row.get("cpu_us_per_request") if row else None
    return float(value) if value is not None else 0.0


def _save(figure: Any, directory: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(directory, name)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
