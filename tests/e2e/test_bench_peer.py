"""bench/load.py --peer (a peer proxy side by side) and --scenario features (the cost table).

Smoke and shape only: nothing here asserts speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import ROOT

BENCH = os.path.join(ROOT, "bench")


def bench_module(name: str):  # noqa: ANN201 - a bench script imported as a module
    sys.path.insert(0, BENCH)
    try:
        return __import__(name)
    finally:
        sys.path.remove(BENCH)


def test_an_unknown_or_missing_peer_is_skipped_with_a_message(capsys):
    load = bench_module("load")
    args = load.parse_args(["--peer", "no-such-router", "--scenario", "chat"])
    assert args.peer == ""  # the run goes on without it
    assert "--peer 'no-such-router': unknown peer" in capsys.readouterr().err


def test_vllm_router_runs_in_pd_mode_against_the_same_backends():
    peer = bench_module("load_peer")
    backends = SimpleNamespace(prefill_url="http://127.0.0.1:1", decode_url="http://127.0.0.1:2",
                               bootstrap_port=3)
    relay = peer.vllm_router_command("vllm-router", backends, "relay", 9)
    assert relay[:5] == ["vllm-router", "--host", "127.0.0.1", "--port", "9"]
    assert "--vllm-pd-disaggregation" in relay and "--kv-connector" not in relay
    assert relay[relay.index("--prefill") + 1] == "http://127.0.0.1:1"
    assert relay[relay.index("--decode") + 1] == "http://127.0.0.1:2"
    mooncake = peer.vllm_router_command("vllm-router", backends, "mooncake", 9)
    at = mooncake.index("--prefill")
    assert mooncake[at + 1:at + 3] == ["http://127.0.0.1:1", "3"]  # the bootstrap port
    assert mooncake[mooncake.index("--kv-connector") + 1] == "mooncake"
    # its Prometheus listener never takes the default port every router shares
    assert int(mooncake[mooncake.index("--prometheus-port") + 1]) > 0


@pytest.mark.skipif(bench_module("load_peer").peer_binary("vllm-router") is None,
                    reason="vllm-router is not installed (pip install vllm-router)")
def test_the_peer_runs_beside_the_proxy_and_figures_are_ratios_to_it(tmp_path):
    document = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    run = subprocess.run(
        [sys.executable, os.path.join(BENCH, "load.py"), "--scenario", "chat",
         "--peer", "vllm-router", "--requests", "100", "--warmup", "0.2", "--concurrency", "4",
         "--loop", "asyncio", "--json-file", str(document)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr + run.stdout
    report = json.loads(document.read_text())
    rows = {(r["scenario"], r["target"]): r for r in report["results"]}
    assert set(rows) == {("chat", "proxy"), ("chat", "peer"), ("chat", "direct")}
    assert rows[("chat", "peer")]["requests"] >= 100 and rows[("chat", "peer")]["errors"] == 0
    assert rows[("chat", "peer")]["cpu_us_per_request"] > 0
    figures = {f["figure"]: f for f in report["runs"][0]["figures"]}
    over = figures["chat c=4: proxy CPU per request / peer's (vllm-router)"]
    proxy_cpu, peer_cpu = (rows[("chat", t)]["cpu_us_per_request"] for t in ("proxy", "peer"))
    assert over["limit"] == 2.1 and over["value"] == pytest.approx(proxy_cpu / peer_cpu)
    assert figures["chat c=4: proxy CPU per request, no errors"]["peer_ratio"] == over["value"]
    assert "proxy / peer" in run.stdout


def test_the_feature_table_gives_each_feature_its_cost_over_the_floor():
    features = bench_module("load_features")
    document = {"rounds": 2, "concurrency": 32, "skipped": ["OpenTelemetry spans"], "rows": [
        {"feature": features.FLOOR_ROW, "default": None, "cpu_us": [400.0, 410.0],
         "cost_median": None, "cost_min": None, "errors": 0},
        {"feature": "access log, text", "default": True, "cpu_us": [430.0, 445.0],
         "cost_median": 32.5, "cost_min": 30.0, "errors": 0},
    ]}
    table = features.markdown(document)
    assert "| access log, text | on | 438 (430-445, 2 runs) | +32 / +30 µs |" in table
    assert "| OpenTelemetry spans | off | not measured (package not installed) | |" in table
    assert "--scenario features --repeat 2" in table
    text = features.render(document)
    assert "access log, text" in text and "+32" in text
    # every optional feature is off in the floor, and each row turns exactly one on
    for _, on, _ in features.FEATURES:
        assert all(features.FLOOR[key] != value for key, value in on.items()
                   if key != "PD_PROXY_LOG_FORMAT"), on
