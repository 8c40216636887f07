"""bench/load.py runs every scenario end to end, with zero errors, and reports every figure.

A smoke run (a few hundred requests per run, 50 slow streams), not a
measurement: nothing here asserts speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT

SCENARIOS = ("chat", "latency", "mooncake", "stream", "idle-streams")
COLUMNS = ("scenario", "target", "conc", "requests", "req/s", "p50 ms", "p99 ms",
           "cpu us/req", "cpu us/chunk", "peak RSS MB", "KB/stream", "errors")


def test_bench_smoke_run_every_scenario(tmp_path):
    document = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "load.py"), "--requests", "200",
         "--warmup", "0.2", "--concurrency", "8", "--stream-chunks", "16",
         "--idle-streams", "50", "--idle-settle", "0.2", "--idle-hold", "1",
         "--timeout", "20", "--json-file", str(document)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr + run.stdout

    # The table: every column, one proxy and one direct row per scenario, targets.
    lines = run.stdout.splitlines()
    header = next(line for line in lines if "scenario" in line and "errors" in line)
    for column in COLUMNS:
        assert column in header, column
    rows = [line.split() for line in lines if line.split()[:1] and
            line.split()[0] in SCENARIOS and len(line.split()) == len(COLUMNS)]
    assert {(row[0], row[1]) for row in rows} == {
        (scenario, target) for scenario in SCENARIOS for target in ("proxy", "direct")}
    assert all(row[-1] == "0" for row in rows), run.stdout
    assert "proxy vs direct to decode:" in run.stdout
    for name in ("chat c=8", "stream:", "idle-streams 50", "latency c=1"):
        assert any(name in line and ("[PASS]" in line or "[FAIL]" in line) for line in lines), name

    # The JSON document: the same figures, all present where they apply.
    report = json.loads(document.read_text())
    results = {(r["scenario"], r["target"]): r for r in report["results"]}
    assert set(results) == {(s, t) for s in SCENARIOS for t in ("proxy", "direct")}
    for (scenario, target), result in results.items():
        assert result["errors"] == 0, result
        assert result["requests"] > 0 and result["rps"] > 0, result
        if scenario == "idle-streams":
            assert result["requests"] == 50, result  # every slow stream opened
            assert result["kb_per_stream"] is not None and result["peak_rss_kb"] > 0
            if target == "proxy":
                assert result["chunks"] > 0 and result["cpu_us_per_chunk"] is not None
            continue
        assert result["requests"] >= 200
        assert 0 < result["p50_ms"] <= result["p99_ms"], result
        if scenario == "stream":
            # every response carried all its chunks (16 + [DONE])
            assert result["chunks"] >= 17 * result["requests"], result
        if target == "proxy":
            assert result["cpu_us_per_request"] > 0 and result["peak_rss_kb"] > 0
            if scenario == "stream":
                assert result["cpu_us_per_chunk"] > 0
    assert {r["scenario"] for r in report["ratios"]} == set(SCENARIOS)
    assert len(report["targets"]) == 4 and all(isinstance(t["pass"], bool)
                                               for t in report["targets"])
