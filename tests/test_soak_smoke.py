"""bench/soak.py runs, injects faults, loses nothing and leaks no descriptor (5 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT


def test_soak_for_five_seconds(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "soak.py"), "--duration", "5",
         "--concurrency", "8", "--report-every", "5", "--loop", "asyncio",
         "--proxy-log", str(tmp_path / "proxy.log")],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])["soak"]
    assert summary["ok"] and summary["proxy_alive"]
    assert summary["served"] > 0 and summary["faults_injected"] > 0
    assert summary["failed_as_expected"] > 0  # the faults reached the clients as errors
    assert summary["lost"] == 0 and summary["unexpected"] == 0
    assert summary["fds_leaked"] <= 0
    assert summary["proxy_after"]["lowproxy_requests_in_flight"] == 0
