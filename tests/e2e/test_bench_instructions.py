"""bench/instructions.py counts the proxy's instructions per request under callgrind.

A smoke run (a few dozen requests), not a measurement: it checks that the count
comes out, is in the range a relayed request takes, and that a feature turned on
(the access line, at info) counts more than with it off. Skipped, with the reason,
where valgrind is not installed (it is no dependency of lowproxy's).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.skipif(shutil.which("valgrind") is None
                                or shutil.which("callgrind_control") is None,
                                reason="valgrind (callgrind) is not installed")
COUNT = re.compile(r"^([0-9.]+)k instructions per request \(relay, not streamed, 40 requests")


def count(*options: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_PROXY_")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "instructions.py"),
                          "--requests", "40", "--warmup", "20", *options],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr + run.stdout
    found = COUNT.match(run.stdout)
    assert found, run.stdout
    return float(found.group(1))


def test_the_count_comes_out_and_a_feature_on_counts_more():
    shipped = count()
    quiet = count("--proxy-env", "PD_PROXY_LOG_LEVEL=warning")
    assert 500 < quiet < shipped < 20000  # thousands: a relayed request, the access line on
