"""Build lowproxy as one file: ``python -m lowproxy.pack -o dist/lowproxy.pyz``.

The result is a zipapp holding lowproxy and the pure-Python packages it needs
at run time (h11, httpcore, anyio and what they require), so that
``python3 -I -S lowproxy.pyz`` runs on a bare CPython 3.10 to 3.13 image with
nothing installed. It is small enough for a Kubernetes ConfigMap.

Dependencies come from the distributions installed for the interpreter that
runs this command: their Requires-Dist lines are followed, with environment
markers evaluated for *every* supported Python version, not only the running
one. So a build on 3.12 still bundles exceptiongroup (needed by anyio on 3.10);
a dependency needed somewhere in that range but not installed stops the build
with the pip command that fixes it.

The archive is reproducible: entries sorted by name, every timestamp taken
from SOURCE_DATE_EPOCH (1980-01-01 when unset), fixed permissions, no
bytecode. The same sources and dependency versions give the same bytes.

This module is left out of the archive: it reads installed distributions from
the file system, which a zipapp has not got.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable

import lowproxy

# Mirrors [project] dependencies in pyproject.toml (tests/test_pack.py checks).
ROOT_REQUIREMENTS = ("h11>=0.14,<1", "httpcore[asyncio]>=1.0.5,<2")

# The Python versions the archive must run on; markers are evaluated for each.
SUPPORTED = tuple((3, minor) for minor in range(10, 14))

# 1980-01-01 00:00:00 UTC: the earliest time a zip entry can carry.
ZIP_EPOCH = 315532800
DEFAULT_OUTPUT = "dist/lowproxy.pyz"
SHEBANG = b"#!/usr/bin/env python3\n"

MAIN_PY = '''\
"""Entry point of the lowproxy single-file build (made by lowproxy.pack)."""
import sys

if sys.version_info < {min_version!r}:
    sys.exit("lowproxy.pyz needs Python {min_text} or newer, not " + sys.version.split()[0])

from lowproxy.daemon import main

sys.exit(main())
'''

# Directories inside a package that are never needed at run time.
SKIPPED_DIRS = frozenset({"__pycache__", "tests", "test"})
LICENSE_NAME = re.compile(r"^(licen[cs]e|copying|notice|authors)", re.IGNORECASE)


class PackError(Exception):
    """The archive cannot be built; the message says why and what to do."""


# -- requirements and markers (a small subset of PEP 508, enough for the
#    dependency tree; anything else is refused rather than guessed)

_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?"
    r"[^;]*(?:;(?P<marker>.*))?$")
_MARKER_TOKEN = re.compile(
    r"\s*(?:(?P<string>'[^']*'|\"[^\"]*\")|(?P<op>===|==|!=|~=|<=|>=|<|>|\(|\))"
    r"|(?P<word>not\s+in\b|[A-Za-z_][A-Za-z0-9_.]*))")
_VERSION_VARIABLES = frozenset({"python_version", "python_full_version"})


@dataclass(frozen=True)
class Requirement:
    name: str
    extras: frozenset[str]
    marker: str


def parse_requirement(text: str) -> Requirement:
    match = _REQUIREMENT.match(text)
    if not match:
        raise PackError(f"cannot parse requirement {text!r}")
    extras = frozenset(normalize(e) for e in (match.group("extras") or "").split(",")
                       if e.strip())
    return Requirement(normalize(match.group("name")), extras,
                       (match.group("marker") or "").strip())


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def target_environment(version: tuple[int, int]) -> dict[str, str]:
    """Marker variables of a CPython on Linux (the images this runs in)."""
    text = f"{version[0]}.{version[1]}"
    return {"python_version": text, "python_full_version": text + ".0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux"}


def marker_applies(marker: str, environment: dict[str, str], extras: Iterable[str]) -> bool:
    """Evaluate a PEP 508 marker; ``extra`` is true for any of ``extras``."""
    if not marker:
        return True
    return any(_MarkerParser(marker, {**environment, "extra": extra}).evaluate()
               for extra in ("", *extras))


class _MarkerParser:
    """Recursive descent over: or-expr := and-expr ('or' and-expr)* ; and so on."""

    def __init__(self, text: str, environment: dict[str, str]) -> None:
        self.text = text
        self.environment = environment
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            if text[position:].strip() == "":
                break
            match = _MARKER_TOKEN.match(text, position)
            if not match:
                raise PackError(f"cannot parse marker {text!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.index = 0

    def evaluate(self) -> bool:
        value = self._or()
        if self.index != len(self.tokens):
            raise PackError(f"cannot parse marker {self.text!r}")
        return value

    def _peek(self) -> str:
        return self.tokens[self.index][1] if self.index < len(self.tokens) else ""

    def _next(self) -> tuple[str, str]:
        if self.index >= len(self.tokens):
            raise PackError(f"marker {self.text!r} ends too early")
        token = self.tokens[self.index]
        self.index += 1
        return token

    def _or(self) -> bool:
        value = self._and()
        while self._peek() == "or":
            self._next()
            value = self._and() or value
        return value

    def _and(self) -> bool:
        value = self._atom()
        while self._peek() == "and":
            self._next()
            value = self._atom() and value
        return value

    def _atom(self) -> bool:
        if self._peek() == "(":
            self._next()
            value = self._or()
            if self._next()[1] != ")":
                raise PackError(f"unbalanced parentheses in marker {self.text!r}")
            return value
        left_kind, left = self._next()
        _, op = self._next()
        right_kind, right = self._next()
        variable = left if left_kind == "word" else right
        if variable not in self.environment:
            raise PackError(f"marker variable {variable!r} is not supported in {self.text!r}")
        left_value = self._value(left_kind, left)
        right_value = self._value(right_kind, right)
        return _compare(left_value, " ".join(op.split()), right_value,
                        as_version=variable in _VERSION_VARIABLES)

    def _value(self, kind: str, token: str) -> str:
        if kind == "string":
            return token[1:-1]
        return self.environment[token]


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _compare(left: str, op: str, right: str, as_version: bool) -> bool:
    if op == "in":
        return left in right
    if op == "not in":
        return left not in right
    if not as_version:
        if op in ("==", "==="):
            return normalize(left) == normalize(right)
        if op == "!=":
            return normalize(left) != normalize(right)
        raise PackError(f"operator {op!r} needs a version")
    a, b = _version_key(left), _version_key(right)
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    if op == "~=":
        prefix = _version_key(right)[:-1]
        return a >= b and a[:len(prefix)] == prefix
    comparisons = {"==": a == b, "===": left == right, "!=": a != b, "<": a < b,
                   "<=": a <= b, ">": a > b, ">=": a >= b}
    if op not in comparisons:
        raise PackError(f"unknown marker operator {op!r}")
    return comparisons[op]


# -- which distributions, which files


@dataclass
class Bundled:
    """One distribution that goes into the archive."""

    name: str
    version: str
    dist_info: str  # the archive folder for its metadata and licenses
    files: dict[str, Path]  # archive name -> source file


def needed_distributions(roots: Iterable[str] = ROOT_REQUIREMENTS,
                         versions: Iterable[tuple[int, int]] = SUPPORTED,
                         ) -> dict[str, metadata.Distribution]:
    """The installed distributions the roots need on any of the target versions."""
    versions = sorted(versions)
    environments = [target_environment(v) for v in versions]
    found: dict[str, metadata.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    pending = [(parse_requirement(text), "lowproxy") for text in roots]
    while pending:
        requirement, wanted_by = pending.pop()
        seen = extras_seen.setdefault(requirement.name, set())
        if requirement.name in found and requirement.extras <= seen:
            continue
        seen |= requirement.extras
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            raise PackError(
                f"{requirement.name} (needed by {wanted_by} on some Python "
                f"{_range_text(versions)}) is not installed for {sys.executable}: "
                f"pip install '{requirement.name}'") from None
        found[requirement.name] = dist
        for text in dist.requires or ():
            child = parse_requirement(text)
            if any(marker_applies(child.marker, env, seen) for env in environments):
                pending.append((child, requirement.name))
    return dict(sorted(found.items()))


def _range_text(versions: Iterable[tuple[int, int]]) -> str:
    listed = sorted(versions)
    return f"{listed[0][0]}.{listed[0][1]}-{listed[-1][0]}.{listed[-1][1]}"


def _wanted(relative: str) -> bool:
    parts = relative.split("/")
    if parts[0] == ".." or any(part in SKIPPED_DIRS for part in parts[:-1]):
        return False
    return not relative.endswith((".pyc", ".pyo"))


def distribution_files(dist: metadata.Distribution) -> Bundled:
    """The importable files and the license files of one installed distribution."""
    name = dist.metadata["Name"]
    version = dist.version
    files: dict[str, Path] = {}
    dist_info = f"{normalize(name).replace('-', '_')}-{version}.dist-info"
    for entry in dist.files or ():
        relative = entry.as_posix()
        if not _wanted(relative):
            continue
        top = relative.split("/")[0]
        source = Path(str(dist.locate_file(entry)))
        if top.endswith(".dist-info"):
            if LICENSE_NAME.match(entry.name) or "/licenses/" in relative:
                inner = relative.split("/", 1)[1]
                files[f"{dist_info}/{inner}"] = source
            continue
        if relative.endswith((".so", ".pyd", ".dll", ".dylib")):
            raise PackError(f"{name} {version} is not pure Python ({relative}); "
                            "the single file cannot carry it")
        if top.endswith((".pth", ".data")) or top.startswith("__editable__"):
            continue
        files[relative] = source
    if not any(not n.startswith(dist_info) for n in files):
        raise PackError(f"{name} {version}: no installed files found (is it an "
                        "editable or egg install?)")
    return Bundled(name, version, dist_info, files)


def lowproxy_files() -> Bundled:
    """lowproxy's own sources, from the package this interpreter imports."""
    package_dir = Path(lowproxy.__file__).resolve().parent
    files: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*")):
        relative = path.relative_to(package_dir.parent).as_posix()
        if not path.is_file() or not _wanted(relative):
            continue
        if path.suffix != ".py" and path.name != "py.typed":
            continue  # editor leftovers and the like: only sources are shipped
        if relative == "lowproxy/pack.py":
            continue  # the build tool is not needed inside the build
        files[relative] = path
    dist_info = f"lowproxy-{lowproxy.__version__}.dist-info"
    license_file = package_dir.parent / "LICENSE"  # a source checkout
    if license_file.is_file():
        files[f"{dist_info}/licenses/LICENSE"] = license_file
    else:  # an installed lowproxy: its wheel carries the license
        try:
            installed = distribution_files(metadata.distribution("lowproxy"))
        except (metadata.PackageNotFoundError, PackError):
            installed = None
        for name, source in (installed.files.items() if installed else ()):
            if name.startswith(installed.dist_info + "/"):
                files[dist_info + name[len(installed.dist_info):]] = source
    return Bundled("lowproxy", lowproxy.__version__, dist_info, files)


def metadata_header(dist: metadata.Distribution | None, bundled: Bundled) -> bytes:
    """A METADATA file without the long description, so importlib.metadata
    (and thus --version) can see the bundled versions inside the archive."""
    if dist is None:
        text = (f"Metadata-Version: 2.1\nName: {bundled.name}\nVersion: {bundled.version}\n"
                "License: Apache-2.0\n")
        for requirement in ROOT_REQUIREMENTS:
            text += f"Requires-Dist: {requirement}\n"
        return text.encode()
    raw = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    header = raw.replace("\r\n", "\n").split("\n\n", 1)[0].rstrip("\n") + "\n"
    kept = [line for line in _header_fields(header)
            if not line.lower().startswith(("description:", "description-content-type:"))]
    return "".join(kept).encode()


def _header_fields(header: str) -> list[str]:
    """Header lines with their continuation lines folded in."""
    fields: list[str] = []
    for line in header.splitlines(keepends=True):
        if line[:1] in (" ", "\t") and fields:
            fields[-1] += line
        else:
            fields.append(line)
    return fields


# -- the archive


def source_date_epoch(environ: dict[str, str] | None = None) -> int:
    environ = dict(os.environ) if environ is None else environ
    text = environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not text:
        return ZIP_EPOCH
    try:
        value = int(text)
    except ValueError:
        raise PackError(f"SOURCE_DATE_EPOCH: {text!r} is not an integer") from None
    return max(value, ZIP_EPOCH)


def _entry(name: str, timestamp: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=time.gmtime(timestamp)[:6])
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3  # Unix, so external_attr carries the mode below
    info.external_attr = (0o100644 & 0xFFFF) << 16
    return info


def build(output: Path, min_version: tuple[int, int] = SUPPORTED[0],
          timestamp: int | None = None) -> tuple[Path, list[Bundled]]:
    """Write the archive to ``output``; return its path and what went in."""
    if min_version not in SUPPORTED:
        raise PackError(f"--min-python must be one of "
                        f"{', '.join(f'{a}.{b}' for a, b in SUPPORTED)}")
    timestamp = source_date_epoch() if timestamp is None else timestamp
    versions = [v for v in SUPPORTED if v >= min_version]
    dists = needed_distributions(versions=versions)
    own = lowproxy_files()
    bundles = [own] + [distribution_files(d) for d in dists.values()]
    entries: dict[str, bytes] = {}
    for bundled, dist in zip(bundles, [None, *dists.values()]):
        for name, source in bundled.files.items():
            if name in entries:
                raise PackError(f"{name} is provided by two distributions")
            entries[name] = source.read_bytes()
        entries[f"{bundled.dist_info}/METADATA"] = metadata_header(dist, bundled)
    entries["__main__.py"] = MAIN_PY.format(
        min_version=min_version, min_text=f"{min_version[0]}.{min_version[1]}").encode()

    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    with open(partial, "wb") as raw:
        raw.write(SHEBANG)
        with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_DEFLATED,
                             compresslevel=9) as archive:
            for name in sorted(entries):
                archive.writestr(_entry(name, timestamp), entries[name], compresslevel=9)
    os.chmod(partial, 0o755)
    os.replace(partial, output)
    return output, bundles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lowproxy.pack",
        description="Build lowproxy and its runtime dependencies as one zipapp, "
        "run as: python3 -I -S lowproxy.pyz [flags]")
    parser.add_argument("-o", "--output", default=DEFAULT_OUTPUT,
                        help=f"where to write the archive (default {DEFAULT_OUTPUT})")
    parser.add_argument("--min-python", default="3.10",
                        help="oldest Python the archive must run on (default 3.10)")
    args = parser.parse_args(argv)
    try:
        major, _, minor = args.min_python.partition(".")
        min_version = (int(major), int(minor))
    except ValueError:
        parser.error(f"--min-python: {args.min_python!r} is not like 3.10")
    try:
        path, bundles = build(Path(args.output), min_version)
    except PackError as exc:
        print(f"lowproxy.pack: {exc}", file=sys.stderr)
        return 1
    data = path.read_bytes()
    print(f"{path}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    for bundled in bundles:
        print(f"  {bundled.name} {bundled.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
