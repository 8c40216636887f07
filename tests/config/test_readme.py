"""The README's promises that can go stale: the configuration reference and set-up commands."""

from __future__ import annotations

import os
import re

from helpers import ROOT
from lowproxy.config import SETTINGS


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as file:
        return file.read()


README = _read("README.md")


def test_every_setting_is_in_the_configuration_reference():
    for setting in SETTINGS:
        row = re.search(rf"^\| `{setting.env}` \| `{re.escape(setting.flag)}` \| `([^`]*)` \|",
                        README, re.M)
        assert row, f"{setting.env} missing from the README's configuration table"
        assert row.group(1) == (setting.default or "(empty)"), setting.env


def test_ci_runs_the_readme_test_command():
    ci = _read(".ci", "run")
    command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && " \
              ".venv/bin/python -m pytest"
    assert command in README and command in ci
    assert "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/lowproxy --demo" \
        in README
