"""bench/load.py runs every scenario end to end, with zero errors, and reports every figure.

Smoke runs (a few hundred requests per run, 50 slow streams, a handful of
trickling streams), not measurements: nothing here asserts speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

BENCH = os.path.join(ROOT, "bench")
SCENARIOS = ("chat", "latency", "mooncake", "stream", "trickle", "workers", "idle-streams")
COLUMNS = ("scenario", "target", "conc", "requests", "req/s", "p50 ms", "p99 ms",
           "cpu us/req", "cpu us/chunk", "peak RSS MB", "KB/stream", "errors")
# (scenario, target) rows a full run prints: workers is compared with chat's direct run,
# latency also times a prefill leg sent straight to prefill.
ROWS = {(s, t) for s in SCENARIOS for t in ("proxy", "direct") if s != "workers"} | {
    ("workers", "proxy"), ("latency", "prefill")}
TARGETS = ("chat c=8: proxy CPU per request", "mooncake c=8: proxy CPU per request",
           "stream 16 chunks: proxy CPU per chunk", "trickle: proxy CPU per event net",
           "workers 2: chat req/s vs one worker", "latency c=1: p50 above direct + prefill",
           "idle-streams 50: proxy memory per open stream")
TRICKLE = ["--trickle-streams", "4", "--trickle-events", "5", "--trickle-interval", "0.01",
           "--trickle-rounds", "1"]


def bench(*options: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    run = subprocess.run([sys.executable, os.path.join(BENCH, "load.py"), *options],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr + run.stdout
    return run


def table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.split()[:1]
            and line.split()[0] in SCENARIOS and len(line.split()) == len(COLUMNS)]


def check_result(result: dict) -> None:
    """One row of the JSON document: every figure present where it applies."""
    scenario, target = result["scenario"], result["target"]
    assert result["errors"] == 0, result
    assert result["requests"] > 0 and result["rps"] > 0, result
    # every CPU figure has a yardstick: the backends' CPU in direct and prefill runs
    if scenario == "idle-streams":
        assert result["requests"] == 50, result  # every slow stream opened
        assert result["kb_per_stream"] is not None and result["peak_rss_kb"] > 0
        assert result["chunks"] > 0 and result["cpu_us_per_chunk"] is not None
        return
    assert result["cpu_us_per_request"] > 0 and result["peak_rss_kb"] > 0, result
    assert 0 < result["p50_ms"] <= result["p99_ms"], result
    if scenario == "trickle":
        assert result["requests"] == 4, result  # one measured round of 4 streams
        assert result["chunks"] == 4 * 6, result  # 5 events and [DONE] each, all counted
        assert result["cpu_us_per_chunk"] > 0
        if target == "proxy":
            assert result["cpu_us_per_chunk_net"] is not None
        return
    assert result["requests"] >= 200
    if target == "proxy":  # the other processes' CPU over the same window
        assert result["backend_cpu_us_per_request"] > 0, result
        assert result["client_cpu_us_per_request"] > 0, result
    if scenario == "stream":
        assert result["chunks"] >= 17 * result["requests"], result  # 16 + [DONE] each
        assert result["cpu_us_per_chunk"] > 0


def test_bench_smoke_run_every_scenario(tmp_path):
    document = tmp_path / "bench.json"
    run = bench("--requests", "200", "--warmup", "0.2", "--concurrency", "8",
                "--stream-chunks", "16", "--idle-streams", "50", "--idle-settle", "0.2",
                "--idle-hold", "1", "--timeout", "20", "--loop", "asyncio", *TRICKLE,
                "--json-file", str(document), "--markdown")

    # The table: every column, every row, the ratios, every target with PASS or FAIL.
    lines = run.stdout.splitlines()
    header = next(line for line in lines if "scenario" in line and "errors" in line)
    for column in COLUMNS:
        assert column in header, column
    rows = table_rows(run.stdout)
    assert {(row[0], row[1]) for row in rows} == ROWS
    assert all(row[-1] == "0" for row in rows), run.stdout
    assert "proxy vs direct to decode:" in run.stdout
    for name in TARGETS:
        assert any(name in line and ("[PASS]" in line or "[FAIL]" in line)
                   for line in lines), name
    assert any("trickle 4x5 events: proxy CPU per event, all in" in line and "[info]" in line
               for line in lines), run.stdout
    assert any("prefill backend's own p50" in line for line in lines)
    assert any("workers 2: machine's ceiling vs one worker" in line and "[info]" in line
               for line in lines), run.stdout

    # The JSON document: the same figures, all present where they apply.
    report = json.loads(document.read_text())
    results = {(r["scenario"], r["target"]): r for r in report["results"]}
    assert set(results) == ROWS
    for result in results.values():
        check_result(result)
    assert len(report["targets"]) == len(TARGETS)
    assert all(isinstance(t["pass"], bool) and t["value"] is not None and t["ratio"] is not None
               for t in report["targets"]), report["targets"]

    # The README's speed table, printed after the run and rendered again from the JSON.
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == "| scenario | figure | asyncio | target |"
    assert any(line.startswith("| trickle | proxy CPU per event net") and "≤ 11.0 µs" in line
               for line in table), table
    again = bench("--from-json", str(document), "--markdown", timeout=30)
    assert [line for line in again.stdout.splitlines() if line.startswith("| ")] == table


def test_bench_smoke_trickle_repeat_uvloop(tmp_path):
    """trickle alone brings chat along (its net figure needs chat's cost of the same run);
    --repeat 2 prints a table per run and the spread between them."""
    document = tmp_path / "bench.json"
    run = bench("--scenario", "trickle", "--loop", "uvloop", "--repeat", "2",
                "--requests", "50", "--warmup", "0.1", "--concurrency", "4", *TRICKLE,
                "--json-file", str(document))
    assert run.stdout.count("lowproxy bench: proxy") == 2
    assert "loop uvloop, run 1 of 2" in run.stdout and "loop uvloop, run 2 of 2" in run.stdout
    summary = run.stdout.split("summary over every loop and run")[1]
    net = next(line for line in summary.splitlines() if "net of chat" in line)
    assert "uvloop#1" in net and "uvloop#2" in net and "spread x" in net, net
    report = json.loads(document.read_text())
    assert {(r["scenario"], r["target"], r["loop"], r["run"]) for r in report["results"]} == {
        (s, t, "uvloop", n) for s in ("chat", "trickle") for t in ("proxy", "direct")
        for n in (1, 2)}
    assert all(r["errors"] == 0 for r in report["results"])


def test_bench_options_parse():
    """--loop both and lists, scenario order and chat brought along, bad values refused."""
    import load  # noqa: PLC0415 - bench/ is on the pytest pythonpath
    args = load.parse_args(["--loop", "asyncio,uvloop", "--scenario", "workers,latency"])
    assert args.loops == ("asyncio", "uvloop")
    assert args.scenarios == ("chat", "latency", "workers")
    assert load.parse_args([]).scenarios == SCENARIOS
    assert load.parse_args(["--loop", "both", "--proxy-cmd", "x"]).loops == ("asyncio", "uvloop")
    for bad in (["--loop", "trio"], ["--scenario", "nope"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            load.parse_args(bad)


def test_floor_proxy_answers_every_request_plain_and_streamed():
    """bench/floor_proxy.py, the yardstick of issue 21 (the brief's constraints with no
    feature at all), works as a relay in the bench: both legs made, decode's answer
    spliced to the client, every request answered without an error (a malformed or
    truncated answer, or a prefill answer without its KV fields, is one), plain and
    streamed, at 1 and 8 in flight, on keep-alive connections."""
    run = bench("--scenario", "chat,latency,stream", "--requests", "60", "--warmup", "0.1",
                "--concurrency", "8", "--stream-chunks", "4", "--loop", "asyncio",
                "--proxy-cmd", f"{sys.executable} {os.path.join(BENCH, 'floor_proxy.py')}")
    rows = {(row[0], row[1]): row for row in table_rows(run.stdout)}
    for scenario in ("chat", "latency", "stream"):
        assert int(rows[(scenario, "proxy")][3]) >= 60, run.stdout  # those in flight end too
        assert rows[(scenario, "proxy")][-1] == "0", run.stdout  # none refused or malformed


def test_replay_label_sets_give_other_orders_and_the_same_figures_each_time():
    """bench/load_replay.py --labels: set 0 is the ports the replay always used, other
    sets other ports (so other rendezvous orders and other figures, as a run over real
    sockets has), and a replay stays deterministic (the tool's whole point)."""
    import load_replay  # noqa: PLC0415 - bench/ is on the pytest pythonpath
    assert load_replay.ports(0, 4) == [9000, 9001, 9002, 9003]
    sets = [load_replay.ports(labels, 4) for labels in range(3)]
    assert all(len(set(ports)) == 4 for ports in sets)
    assert len({port for ports in sets for port in ports}) == 12  # no port shared by two sets
    first = load_replay.replay("mix", 4, 1, 7, labels=1)
    assert first == load_replay.replay("mix", 4, 1, 7, labels=1)
    assert 0.0 < first[0] < 1.0 and first[1] >= 1.0
    assert first[0] != load_replay.replay("mix", 4, 1, 7, labels=0)[0]
