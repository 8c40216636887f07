"""What bench/load.py prints: figures from one run's results, each as a ratio to the
direct-to-decode run of the same invocation, and the targets of issue 16.

Everything here works from Result rows and the settings, so a saved --json-file
renders again (``--from-json PATH [--markdown]``) without running anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from load_client import Result

Group = dict[tuple[str, str], Result]  # (scenario, target) -> the rows of one loop and run


def group_by_run(results: list[Result]) -> dict[tuple[str, int], Group]:
    groups: dict[tuple[str, int], Group] = {}
    for r in results:
        groups.setdefault((r.loop, r.run), {})[(r.scenario, r.target)] = r
    return groups


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fill_net(group: Group) -> None:
    """trickle: CPU per event net of chat's per-request cost, from the same loop and run.
    A trickle request pays what a chat request pays (client exchange, prefill leg,
    decode leg); what is left over is what relaying its events costs."""
    chat, trickle = group.get(("chat", "proxy")), group.get(("trickle", "proxy"))
    if (chat and trickle and chat.cpu_us_per_request is not None
            and trickle.cpu_us_per_request is not None and trickle.chunks):
        net = (trickle.cpu_us_per_request - chat.cpu_us_per_request) * trickle.requests
        trickle.cpu_us_per_chunk_net = net / trickle.chunks


def _get(group: Group, scenario: str, target: str, name: str) -> Any:
    row = group.get((scenario, target))
    return getattr(row, name) if row is not None else None


def _errors(group: Group, scenario: str) -> int:
    row = group.get((scenario, "proxy"))
    return row.errors if row is not None else 0


def _cpu(scenario: str, name: str = "cpu_us_per_request") -> tuple[Callable, Callable]:
    """The proxy's CPU figure and its ratio to the backend's CPU in the direct run."""
    def value(g: Group, s: Any) -> Any:
        return _get(g, scenario, "proxy", name)

    def ratio(g: Group, s: Any) -> Any:
        return _div(value(g, s), _get(g, scenario, "direct", name))
    return value, ratio


def _peer(scenario: str, name: str = "cpu_us_per_request") -> Callable:
    """The peer's row's figure: what lowproxy's is quoted against."""
    return lambda g, s: _get(g, scenario, "peer", name)


def _over_peer(scenario: str, name: str = "cpu_us_per_request") -> tuple[Callable, Callable]:
    """The proxy's figure as a multiple of the peer's, and the peer's over direct's."""
    def value(g: Group, s: Any) -> Any:
        return _div(_get(g, scenario, "proxy", name), _get(g, scenario, "peer", name))

    def ratio(g: Group, s: Any) -> Any:
        return _div(_get(g, scenario, "peer", name), _get(g, scenario, "direct", name))
    return value, ratio


def _peer_latency_added(g: Group, s: Any) -> float | None:
    through, direct, prefill = (_get(g, "latency", t, "p50_ms")
                                for t in ("peer", "direct", "prefill"))
    if through is None or direct is None or prefill is None:
        return None
    return through - direct - prefill


def _stream_extra(g: Group, s: Any) -> float | None:
    chunks = s.stream_chunks
    stream, chat = _get(g, "stream", "proxy", "cpu_us_per_request"), _get(
        g, "chat", "proxy", "cpu_us_per_request")
    if stream is None or chat is None or not chunks:
        return None
    return (stream - chat) / chunks


def _latency_added(g: Group, s: Any) -> float | None:
    """p50 through the proxy minus (decode's own p50 + prefill's own p50)."""
    through, direct, prefill = (_get(g, "latency", t, "p50_ms")
                                for t in ("proxy", "direct", "prefill"))
    if through is None or direct is None or prefill is None:
        return None
    return through - direct - prefill


def _ceiling_rps(g: Group, s: Any) -> float | None:
    """The req/s this machine allows at best: cpus / (CPU of proxy, backends and load
    client per request, from the workers run). When they all share the cores, more
    workers cannot go faster than this, however the proxy's work is spread."""
    row = g.get(("workers", "proxy"))
    if row is None or not getattr(s, "cpus", None):
        return None
    parts = (row.cpu_us_per_request, row.backend_cpu_us_per_request,
             row.client_cpu_us_per_request)
    total = sum(p for p in parts if p is not None)
    if None in parts or not total:
        return None
    return s.cpus * 1e6 / total


@dataclass
class Figure:
    scenario: str  # whose proxy row's errors make its target fail
    label: str  # str.format()ted with the settings
    unit: str
    value: Callable[[Group, Any], float | None]  # (rows, settings)
    ratio: Callable[[Group, Any], float | None]  # to the direct-to-decode run
    ratio_of: str  # what the ratio compares
    limit: float | None = None
    at_most: bool = True
    # The same figure of the peer (--peer), when it ran: what the ratio to it divides by.
    peer: Callable[[Group, Any], float | None] | None = None

    needs_peer: bool = False  # shown only when the peer ran (a ratio to it)

    def name(self, settings: Any) -> str:
        return self.label.format(**{"peer": "", **vars(settings)})

    def check(self, group: Group, settings: Any
              ) -> tuple[float | None, float | None, bool | None]:
        """(value, ratio, pass or None when this figure has no target)."""
        value, ratio = self.value(group, settings), self.ratio(group, settings)
        if self.limit is None:
            return value, ratio, None
        ok = value is not None and _errors(group, self.scenario) == 0 and (
            value <= self.limit if self.at_most else value >= self.limit)
        return value, ratio, ok


def _figures() -> list[Figure]:
    decode_cpu = "decode backend's CPU"
    return [
        Figure("chat", "chat c={concurrency}: proxy CPU per request, no errors", "us",
               *_cpu("chat"), decode_cpu, limit=330.0, peer=_peer("chat")),
        Figure("chat", "chat c={concurrency}: proxy CPU per request / peer's ({peer})", "x",
               *_over_peer("chat"), "peer's CPU over the decode backend's", limit=2.1,
               needs_peer=True),
        Figure("chat", "chat c={concurrency}: req/s", "",
               lambda g, s: _get(g, "chat", "proxy", "rps"),
               lambda g, s: _div(_get(g, "chat", "proxy", "rps"), _get(g, "chat", "direct", "rps")),
               "direct req/s"),
        Figure("mooncake", "mooncake c={concurrency}: proxy CPU per request, no errors", "us",
               *_cpu("mooncake"), decode_cpu, limit=330.0, peer=_peer("mooncake")),
        Figure("mooncake", "mooncake c={concurrency}: proxy CPU per request / peer's "
               "({peer})", "x", *_over_peer("mooncake"), "peer's CPU over the decode "
               "backend's", limit=2.1, needs_peer=True),
        Figure("stream", "stream {stream_chunks} chunks: proxy CPU per chunk", "us",
               *_cpu("stream", "cpu_us_per_chunk"), decode_cpu, limit=10.0,
               peer=_peer("stream", "cpu_us_per_chunk")),
        Figure("stream", "stream: proxy CPU per extra chunk, (stream - chat) / chunks", "us",
               _stream_extra,
               lambda g, s: _div(_stream_extra(g, s),
                              _get(g, "stream", "direct", "cpu_us_per_chunk")), decode_cpu),
        Figure("trickle", "trickle {trickle_streams}x{trickle_events} events: proxy CPU per "
               "event, all in", "us", *_cpu("trickle", "cpu_us_per_chunk"), decode_cpu,
               peer=_peer("trickle", "cpu_us_per_chunk")),
        Figure("trickle", "trickle: proxy CPU per event, all in / peer's ({peer})", "x",
               *_over_peer("trickle", "cpu_us_per_chunk"), "peer's CPU over the decode "
               "backend's", limit=1.0, needs_peer=True),
        Figure("trickle", "trickle: proxy CPU per event net of chat's per-request cost", "us",
               lambda g, s: _get(g, "trickle", "proxy", "cpu_us_per_chunk_net"),
               lambda g, s: _div(_get(g, "trickle", "proxy", "cpu_us_per_chunk_net"),
                              _get(g, "trickle", "direct", "cpu_us_per_chunk")),
               decode_cpu, limit=11.0),
        Figure("workers", "workers {workers}: chat req/s vs one worker", "x",
               lambda g, s: _div(_get(g, "workers", "proxy", "rps"),
                              _get(g, "chat", "proxy", "rps")),
               lambda g, s: _div(_get(g, "workers", "proxy", "rps"),
                              _get(g, "chat", "direct", "rps")),
               "direct req/s", limit=1.7, at_most=False),
        Figure("workers", "workers {workers}: machine's ceiling vs one worker, cpus / CPU "
               "of proxy + backends + client per request", "x",
               lambda g, s: _div(_ceiling_rps(g, s), _get(g, "chat", "proxy", "rps")),
               lambda g, s: _div(_ceiling_rps(g, s), _get(g, "chat", "direct", "rps")),
               "direct req/s"),
        Figure("latency", "latency c=1: prefill backend's own p50", "ms",
               lambda g, s: _get(g, "latency", "prefill", "p50_ms"),
               lambda g, s: _div(_get(g, "latency", "prefill", "p50_ms"),
                              _get(g, "latency", "direct", "p50_ms")), "direct p50"),
        Figure("latency", "latency c=1: p50 above direct + prefill's own p50", "ms",
               _latency_added,
               lambda g, s: _div(_get(g, "latency", "proxy", "p50_ms"),
                              _get(g, "latency", "direct", "p50_ms")),
               "direct p50 (proxy p50 / direct p50)", limit=0.5),
        Figure("latency", "latency c=1: peer's ({peer}) p50 above direct + prefill's own p50",
               "ms", _peer_latency_added,
               lambda g, s: _div(_get(g, "latency", "peer", "p50_ms"),
                              _get(g, "latency", "direct", "p50_ms")),
               "direct p50 (peer p50 / direct p50)", needs_peer=True),
        Figure("idle-streams", "idle-streams {idle_streams}: proxy memory per open stream, "
               "no errors", "KB", *_cpu("idle-streams", "kb_per_stream"),
               "decode backend's KB/stream", limit=20.0),
        Figure("idle-streams", "idle-streams: proxy CPU per trickled chunk", "us",
               *_cpu("idle-streams", "cpu_us_per_chunk"), decode_cpu),
    ]


FIGURES = _figures()


def evaluate(group: Group, settings: Any) -> list[dict[str, Any]]:
    """Every figure whose scenario ran, with its ratio and, for targets, PASS/FAIL."""
    fill_net(group)
    found = []
    for figure in FIGURES:
        if (figure.scenario, "proxy") not in group:
            continue
        if figure.needs_peer and (figure.scenario, "peer") not in group:
            continue
        value, ratio, ok = figure.check(group, settings)
        peer = figure.peer(group, settings) if figure.peer is not None else None
        found.append({"figure": figure.name(settings), "scenario": figure.scenario,
                      "unit": figure.unit, "value": value, "limit": figure.limit,
                      "at_most": figure.at_most, "pass": ok, "ratio": ratio,
                      "ratio_of": figure.ratio_of,
                      "peer_ratio": _div(value, peer) if peer is not None and peer > 0
                      else None})
    return found
