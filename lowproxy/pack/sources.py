"""What goes into the single-file build: distributions, their files, their metadata.

Dependencies come from the distributions installed for the interpreter that
runs lowproxy.pack: their Requires-Dist lines are followed, with environment
markers evaluated for *every* supported Python version, not only the running
one. So a build on 3.12 still bundles exceptiongroup (needed by anyio on 3.10);
a dependency needed somewhere in that range but not installed stops the build
with the pip command that fixes it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import lowproxy

from .markers import PackError, marker_applies, normalize, parse_requirement, target_environment

# The roots of what the archive bundles: [project] dependencies in pyproject.toml
# (tests/pack/test_pack.py checks they are declared there).
ROOT_REQUIREMENTS = ("h11>=0.14,<1", "httpcore[asyncio]>=1.0.5,<1.1")

# The Python versions the archive must run on; markers are evaluated for each.
SUPPORTED = tuple((3, minor) for minor in range(10, 14))

# Directories inside a package that are never needed at run time.
SKIPPED_DIRS = frozenset({"__pycache__", "tests", "test"})
# lowproxy.pack, the build tool: build-time only, left out of the archive.
PACK_MODULE = re.compile(r"^lowproxy/pack/[a-z_]+\.py$")
LICENSE_NAME = re.compile(r"^(licen[cs]e|copying|notice|authors)", re.IGNORECASE)

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
        if PACK_MODULE.match(relative):
            continue  # the build tool is not needed inside the build
        files[relative] = path
    dist_info = f"lowproxy-{lowproxy.__version__}.dist-info"
    license_file = package_dir.parent / "LICENSE"  # a source checkout
    if license_file.is_file():
        files[f"{dist_info}/licenses/LICENSE"] = license_file
    else:  # an installed lowproxy: its wheel carries the license
        files.update(_installed_licenses(dist_info))
    return Bundled("lowproxy", lowproxy.__version__, dist_info, files)


def _installed_licenses(dist_info: str) -> dict[str, Path]:
    """The license files of an installed lowproxy wheel, renamed under ``dist_info``."""
    try:
        installed = distribution_files(metadata.distribution("lowproxy"))
    except (metadata.PackageNotFoundError, PackError):
        return {}
    prefix = installed.dist_info + "/"
    return {dist_info + "/" + name[len(prefix):]: source
            for name, source in installed.files.items() if name.startswith(prefix)}


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
