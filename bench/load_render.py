"""bench/load.py's output: one text table per loop and run, a summary across them (the
spread), and the README's speed table as markdown."""

from __future__ import annotations

from typing import Any

from load_client import Result
from load_report import Group

COLUMNS = (("scenario", 12), ("target", 7), ("conc", 5), ("requests", 8), ("req/s", 8),
           ("p50 ms", 8), ("p99 ms", 8), ("cpu us/req", 10), ("cpu us/chunk", 12),
           ("peak RSS MB", 11), ("KB/stream", 9), ("errors", 6))
FOOTNOTE = (
    "cpu: utime+stime over the measured window of the proxy process and its children "
    "(proxy rows) or of the emulated backends' process (direct and prefill rows: the "
    "yardstick of the CPU ratios). direct = the same load sent straight to decode; "
    "prefill = latency's prefill-leg body sent straight to prefill. trickle: requests = "
    "streams, p50 = a whole stream, cpu us/chunk = per relayed SSE event. idle-streams: "
    "requests = streams open, req/s = streams opened per second, KB/stream = (RSS with all "
    "open - RSS before) / streams, cpu us/chunk = while they trickle.")


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fmt_figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    digits = {"ms": 2, "x": 2, "KB": 1, "": 0}.get(unit, 0 if abs(value) >= 100 else 1)
    if unit == "x":
        return f"x{value:.{digits}f}"
    return f"{value:.{digits}f}" + (f" {unit}" if unit else "")


def _row(r: Result) -> str:
    row = (r.scenario, r.target, r.concurrency, r.requests, fmt(r.rps, 0),
           fmt(r.p50_ms, 2), fmt(r.p99_ms, 2), fmt(r.cpu_us_per_request, 0),
           fmt(r.cpu_us_per_chunk, 2),
           fmt(r.peak_rss_kb / 1024 if r.peak_rss_kb is not None else None, 1),
           fmt(r.kb_per_stream, 1), r.errors)
    cells = zip(row, COLUMNS, strict=True)
    return "  ".join(str(value).rjust(width) for value, (_, width) in cells)


def direct_ratios(group: Group) -> list[str]:
    """Per scenario: every figure of the proxy row (and the peer's) over the same figure of
    its direct row, and the proxy's over the peer's (workers has no direct run of its
    own: chat's is the same load)."""
    lines = []
    names = dict.fromkeys(scenario for scenario, _ in group)
    for scenario in names:
        direct = group.get((scenario if scenario != "workers" else "chat", "direct"))
        peer = group.get((scenario, "peer"))
        for target, against in (("proxy", direct), ("peer", direct), ("proxy", peer)):
            line = _ratios(scenario, group.get((scenario, target)), against,
                           f"{target} / {'peer' if against is peer else 'direct'}")
            if line is not None:
                lines.append(line)
    return lines


def _ratios(scenario: str, through: Result | None, direct: Result | None,
            what: str) -> str | None:
    """Every figure of one row over the same figure of another."""
    if through is None or direct is None:
        return None
    parts = []
    for label, name in (("req/s", "rps"), ("p50", "p50_ms"), ("p99", "p99_ms"),
                        ("cpu/req", "cpu_us_per_request"), ("cpu/chunk", "cpu_us_per_chunk"),
                        ("peak RSS", "peak_rss_kb"), ("KB/stream", "kb_per_stream")):
        a, b = getattr(through, name), getattr(direct, name)
        if a is not None and b:
            extra = f" ({a - b:+.2f} ms)" if name == "p50_ms" else ""
            parts.append(f"{label} x{a / b:.2f}{extra}")
    return f"  {scenario:<12} {what:<15} " + ", ".join(parts)


def _verdict(entry: dict[str, Any]) -> str:
    return {True: "PASS", False: "FAIL", None: "info"}[entry["pass"]]


def _limit(entry: dict[str, Any]) -> str:
    sign = "<=" if entry["at_most"] else ">="
    return f"{sign} {fmt_figure(entry['limit'], entry['unit'])}"


def figure_line(entry: dict[str, Any]) -> str:
    target = f" (target {_limit(entry)})" if entry["limit"] is not None else ""
    ratio = (f", x{entry['ratio']:.2f} {entry['ratio_of']}" if entry["ratio"] is not None
             else "")
    if entry.get("peer_ratio") is not None:
        ratio += f", x{entry['peer_ratio']:.2f} the peer's"
    return (f"  [{_verdict(entry)}] {entry['figure']}: "
            f"{fmt_figure(entry['value'], entry['unit'])}{ratio}{target}")


def table(group: Group, figures: list[dict[str, Any]], title: str) -> str:
    lines = [title, "  ".join(name.rjust(width) for name, width in COLUMNS)]
    for r in group.values():
        lines.append(_row(r))
        if r.error_kinds:
            lines.append(" " * 14 + "errors: " + ", ".join(f"{k} x{v}"
                                                          for k, v in r.error_kinds.items()))
    lines += ["", "proxy vs direct to decode: (with --peer also peer / direct and proxy / peer)",
              *direct_ratios(group), "",
              "figures and targets (x: ratio to the direct run of this invocation):"]
    lines += [figure_line(entry) for entry in figures]
    return "\n".join(lines)


def summary(runs: list[dict[str, Any]]) -> str:
    """Every figure across loops and runs, and its spread (max / min)."""
    lines = ["summary over every loop and run (spread = max / min):"]
    for name in dict.fromkeys(e["figure"] for run in runs for e in run["figures"]):
        cells, values = [], []
        for run in runs:
            for entry in run["figures"]:
                if entry["figure"] != name:
                    continue
                verdict = "" if entry["pass"] is None else " " + _verdict(entry)
                cells.append(f"{run['loop']}#{run['run']} "
                             f"{fmt_figure(entry['value'], entry['unit'])}{verdict}")
                if entry["value"] is not None and entry["value"] > 0:
                    values.append(entry["value"])
        spread = f"; spread x{max(values) / min(values):.2f}" if len(values) > 1 else ""
        lines.append(f"  {name}: " + "; ".join(cells) + spread)
    return "\n".join(lines)


def markdown(runs: list[dict[str, Any]], settings: Any, cpus: int | None) -> str:
    """The README's speed table: one column per loop, runs side by side in a cell."""
    loops = list(dict.fromkeys(run["loop"] for run in runs))
    repeat = max(run["run"] for run in runs)
    per_run = f"{settings.requests} requests" if settings.requests else f"{settings.duration:g} s"
    lines = [f"`python bench/load.py` on {cpus} cpus, {per_run} per run, "
             f"{repeat} run(s) per loop; ×: ratio to the direct-to-decode run of the same "
             "invocation (CPU: to the decode backend's own CPU)"
             + (f"; [× peer]: ratio to {settings.peer} in the same invocation"
                if getattr(settings, "peer", "") else "") + ".", "",
             "| scenario | figure | " + " | ".join(loops) + " | target |",
             "|---|---|" + "---|" * len(loops) + "---|"]
    for name in dict.fromkeys(e["figure"] for run in runs for e in run["figures"]):
        scenario, _, what = name.partition(": ")
        cells, limit = [], ""
        for loop in loops:
            parts = []
            for run in runs:
                entry = next((e for e in run["figures"] if e["figure"] == name), None)
                if run["loop"] != loop or entry is None:
                    continue
                text = fmt_figure(entry["value"], entry["unit"]).replace("us", "µs")
                if entry["ratio"] is not None:
                    text += f" (×{entry['ratio']:.2f})"
                if entry.get("peer_ratio") is not None:
                    text += f" [×{entry['peer_ratio']:.2f} peer]"
                if entry["pass"] is not None:
                    text += f" {_verdict(entry)}"
                    limit = _limit(entry).replace("<=", "≤").replace(">=", "≥ ").replace(
                        "≥  x", "≥ ×")
                parts.append(text.replace("x", "×", 1) if entry["unit"] == "x" else text)
            cells.append(" / ".join(parts) or "-")
        lines.append(f"| {scenario} | {what} | " + " | ".join(cells) + f" | "
                     f"{limit.replace('us', 'µs')} |")
    return "\n".join(lines)
