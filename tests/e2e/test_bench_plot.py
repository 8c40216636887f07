"""bench/load.py --plot DIR: charts when matplotlib is there, the way to get it when not.

A smoke run (a few dozen requests), not a measurement: nothing here asserts speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

CHARTS = ("latency_cdf.png", "cpu_per_request.png")
SMALL = ["--scenario", "latency", "--requests", "40", "--warmup", "0.1", "--loop", "asyncio",
         "--timeout", "20"]


def bench(*options: str, prelude: str = "pass") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    code = (f"import runpy, sys; {prelude}; sys.argv = ['bench/load.py', *{list(options)!r}]; "
            "sys.path.insert(0, 'bench'); runpy.run_path('bench/load.py', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


def test_plot_writes_the_charts(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need lowproxy[bench], not in the test extra")
    saved, charts = tmp_path / "run.json", tmp_path / "charts"
    run = bench(*SMALL, "--json-file", str(saved), "--plot", str(charts))
    assert run.returncode == 0, run.stderr
    for name in CHARTS:
        path = charts / name
        assert f"wrote {path}" in run.stderr
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The distribution it draws: 101 percentiles, in order, for proxy and direct alike.
    document = json.loads(saved.read_text())
    for row in document["results"]:
        cdf = row["latency_cdf_ms"]
        assert len(cdf) == 101 and cdf == sorted(cdf) and cdf[0] > 0, row["target"]
    # A saved run re-drawn, with a peer's run beside it.
    again = tmp_path / "again"
    run = bench("--from-json", str(saved), "--plot", str(again), "--plot-peer", str(saved))
    assert run.returncode == 0, run.stderr
    assert sorted(os.listdir(again)) == sorted(CHARTS)


def test_plot_without_matplotlib_says_how_to_get_it_before_any_load(tmp_path):
    charts = tmp_path / "charts"
    # sys.modules[name] = None: the import system then finds no such module.
    run = bench(*SMALL, "--plot", str(charts), prelude="sys.modules['matplotlib'] = None")
    assert run.returncode == 2, run.stderr + run.stdout
    assert "pip install 'lowproxy[bench]'" in run.stderr
    assert "matplotlib" in run.stderr
    assert run.stdout == "" and not charts.exists()  # no load ran, nothing written


def test_the_peer_is_named_by_its_command():
    import load_plot  # noqa: PLC0415 - bench/ is on the pytest pythonpath
    assert load_plot.proxy_label({"proxy_cmd": [sys.executable, "-m", "lowproxy"]}) == "lowproxy"
    assert load_plot.proxy_label({"proxy_cmd": ["python3", "-u", "/x/pd_proxy.py"]}) == \
        "pd_proxy.py"
