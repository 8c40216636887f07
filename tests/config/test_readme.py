"""The README's promises that can go stale: the configuration reference and set-up commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import ROOT
from lowproxy.config import SETTINGS


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as file:
        return file.read()


README = _read("README.md")


def test_every_setting_is_in_the_configuration_reference():
    for setting in SETTINGS:
        row = re.search(rf"^\| `{setting.env}` \| `{re.escape(setting.flags)}` \| `([^`]*)` \|",
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


# -- every table that names settings, against what `lowproxy --help` knows


def help_options() -> dict[str, set[str]]:
    """`lowproxy --help`: each setting's variable with its flags; flags without
    a variable (--demo, --version) under ""."""
    out = subprocess.run([sys.executable, "-m", "lowproxy", "--help"], cwd=ROOT,
                         env=dict(os.environ, COLUMNS="200"), capture_output=True,
                         text=True, check=True, timeout=60).stdout
    blocks: list[list[str]] = []
    for line in out.split("options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            blocks.append([line])
        elif blocks and line.startswith("   "):
            blocks[-1].append(line)
    options: dict[str, set[str]] = {}
    for block in blocks:
        names = re.split(r"\s{2,}", block[0].strip(), maxsplit=1)[0]
        flags = set(re.findall(r"--[a-z][a-z0-9-]*", names)) - {"--help"}
        env = re.search(r"\benv\s+([A-Z][A-Z0-9_]*)", " ".join(block))
        options.setdefault(env.group(1) if env else "", set()).update(flags)
    return options


def tables(text: str) -> list[tuple[int, list[str]]]:
    """Each markdown table outside code blocks: (first line number, its lines)."""
    found: list[tuple[int, list[str]]] = []
    in_code, previous = False, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        is_row = not in_code and line.startswith("|")
        if is_row and not previous:
            found.append((number, []))
        if is_row:
            found[-1][1].append(line)
        previous = is_row
    return found


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def documents_with_tables() -> dict[str, str]:
    return {"README.md": README, "deploy/kubernetes/README.md":
            _read("deploy", "kubernetes", "README.md"),
            "docs/migration-from-gco.md": _read("docs", "migration-from-gco.md")}


def test_every_table_starts_with_its_header_and_keeps_its_width():
    for name, text in documents_with_tables().items():
        for number, lines in tables(text):
            assert len(lines) >= 3 and re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", lines[1]), \
                f"{name}:{number}: a table's second line is its header separator"
            width = len(cells(lines[0]))
            for offset, line in enumerate(lines):
                assert len(cells(line)) == width, f"{name}:{number + offset}: {line[:60]}"


def test_tables_name_only_settings_help_knows():
    options = help_options()
    known = set(options) - {""}
    all_flags = set().union(*options.values())
    for name, text in documents_with_tables().items():
        for number, lines in tables(text):
            named = set(re.findall(r"\b(PD_PROXY_[A-Z0-9_]*[A-Z0-9]|ADMIN_API_KEY)\b",
                                   "\n".join(lines)))
            assert named <= known, f"{name}:{number}: not settings: {sorted(named - known)}"
            header = cells(lines[0])
            if "Flag" in header:
                column = header.index("Flag")
                for line in lines[2:]:
                    flags = set(re.findall(r"--[a-z][a-z0-9-]*", cells(line)[column]))
                    assert flags <= all_flags, f"{name}:{number}: {sorted(flags - all_flags)}"


def configuration_table() -> dict[str, set[str]]:
    (lines,) = [lines for _, lines in tables(README)
                if cells(lines[0]) == ["Variable", "Flag", "Default", "Meaning"]]
    rows: dict[str, set[str]] = {}
    for line in lines[2:]:
        variable, flag = cells(line)[:2]
        env = variable.strip("`")
        assert env not in rows or env == "", f"{env} twice in the Configuration table"
        rows.setdefault(env, set()).update(re.findall(r"--[a-z][a-z0-9-]*", flag))
    return rows


def test_the_configuration_table_lists_every_setting_help_lists():
    options, rows = help_options(), configuration_table()
    assert len(options) > 40 and {"", "PD_PROXY_WORKERS"} <= set(options)
    assert set(rows) == set(options), (sorted(set(options) - set(rows)),
                                       sorted(set(rows) - set(options)))
    for env, flags in options.items():
        assert rows[env], f"{env}: no flag in the Configuration table"
        assert rows[env] <= flags and (env or flags <= rows[env]), (env, rows[env], flags)


# -- one source for each step


def commands(text: str) -> list[str]:
    """The shell commands of a text's sh blocks, continuation lines joined."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+", " ", command.split("  #")[0]).strip()
            if command:
                found.append(command)
    return found


def test_the_quick_kubernetes_path_uses_the_kubernetes_readme_commands():
    section = README.split("## Deploying", 1)[1].split("\n## ", 1)[0]
    quick = [c for c in commands(section) if c.startswith(("kubectl ", "python -m lowproxy"))]
    assert any(c.startswith("kubectl apply -k deploy/kubernetes/") for c in quick)
    detailed = commands(_read("deploy", "kubernetes", "README.md"))
    for command in quick:
        assert command in detailed, f"{command!r}: not the command deploy/kubernetes gives"


def slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_the_table_of_contents_lists_every_section():
    toc = README.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    linked = re.findall(r"\]\(#([^)]+)\)", toc)
    body = re.sub(r"```.*?```", "", README, flags=re.S)
    headings = [slug(title) for title in re.findall(r"^###? (.+)$", body, re.M)]
    assert linked == [anchor for anchor in headings if anchor != "contents"]


def test_pyproject_cites_only_files_in_the_repository():
    text = _read("pyproject.toml")
    cited = set(re.findall(r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)+\.(?:md|py|toml|txt|yaml))", text))
    assert "tests/upstream/test_httpcore_fence.py" in cited
    missing = sorted(path for path in cited if not os.path.exists(os.path.join(ROOT, path)))
    assert not missing, f"pyproject.toml cites files outside the repository: {missing}"


# -- the docs a user looks for

# Every variable the GCO Mooncake PD proxy (gco/services/mooncake_pd_proxy.py) reads.
GCO_VARIABLES = ("PD_PROXY_HOST", "PD_PROXY_PORT", "PD_PROXY_PREFILL_URL", "PD_PROXY_DECODE_URL",
                 "PD_PROXY_CA_FILE", "PD_PROXY_RESIDENCY_TIMEOUT_SECONDS",
                 "PD_PROXY_NO_DECODE_BACKEND_STATUS", "PD_PROXY_NO_DECODE_BACKEND_MESSAGE",
                 "ADMIN_API_KEY")
# Its routes: the two health paths, the admin path, the generation suffixes, passthrough.
GCO_ROUTES = ("`GET /health`", "`GET /healthz`", "`POST …/instances/add`",
              "`POST …/chat/completions`", "`POST …/completions`", "`POST …/embeddings`",
              "other `POST`s", "other `GET`s", "`GET /metrics`", "`GET /readyz`")


def test_the_migration_guide_covers_every_gco_variable_and_route():
    guide = _read("docs", "migration-from-gco.md")
    assert "GCO Mooncake prefill-decode (PD) proxy" in guide
    (variables,) = [lines for _, lines in tables(guide) if "GCO proxy variable" in lines[0]]
    assert [cells(line)[0].strip("`") for line in variables[2:]] == list(GCO_VARIABLES)
    (routes,) = [lines for _, lines in tables(guide) if cells(lines[0])[0] == "Request"]
    first = " ".join(cells(line)[0] for line in routes[2:])
    for route in GCO_ROUTES:
        assert route in first, route
    assert "docs/migration-from-gco.md" in README


def test_the_changelog_keeps_unreleased_on_top_and_issues_most_recent_first():
    changelog = _read("CHANGELOG.md")
    headings = re.findall(r"^## (.+)$", changelog, re.M)
    assert headings[0] == "Unreleased"
    numbers = [int(n) for n in re.findall(r"^## Issue (\d+)", changelog, re.M)]
    assert len(numbers) >= 10 and numbers == sorted(numbers, reverse=True)
    unreleased = changelog.split("## Unreleased", 1)[1].split("\n## ", 1)[0]
    assert "**Issue 23" in unreleased
