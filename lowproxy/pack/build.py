"""Build lowproxy as one file: ``python -m lowproxy.pack -o dist/lowproxy.pyz``.

The result is a zipapp holding lowproxy and the pure-Python packages it needs
at run time (h11, httpcore, anyio and what they require), so that
``python3 -I -S lowproxy.pyz`` runs on a bare CPython 3.10 to 3.13 image with
nothing installed. It is small enough for a Kubernetes ConfigMap. Which
distributions and files go in is sources.py's business; requirement and
marker parsing is markers.py's.

The archive is reproducible: entries sorted by name, every timestamp taken
from SOURCE_DATE_EPOCH (1980-01-01 when unset), fixed permissions, no
bytecode. The same sources and dependency versions give the same bytes.

These three modules are left out of the archive: they read installed
distributions from the file system, which a zipapp has not got.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import zipfile
from pathlib import Path

from .markers import PackError
from .sources import (
    SUPPORTED,
    Bundled,
    distribution_files,
    lowproxy_files,
    metadata_header,
    needed_distributions,
)

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


def size_kib(size: int) -> int:
    """The archive size as the README states it: whole KiB, rounded."""
    return (size + 512) // 1024


def _entry(name: str, timestamp: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=time.gmtime(timestamp)[:6])
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3  # Unix, so external_attr carries the mode below
    info.external_attr = (0o100644 & 0xFFFF) << 16
    return info


def archive_entries(min_version: tuple[int, int]) -> tuple[dict[str, bytes], list[Bundled]]:
    """Every archive member by name, and the distributions they came from."""
    versions = [v for v in SUPPORTED if v >= min_version]
    dists = needed_distributions(versions=versions)
    own = lowproxy_files()
    bundles = [own] + [distribution_files(d) for d in dists.values()]
    entries: dict[str, bytes] = {}
    for bundled, dist in zip(bundles, [None, *dists.values()], strict=True):
        for name, source in bundled.files.items():
            if name in entries:
                raise PackError(f"{name} is provided by two distributions")
            entries[name] = source.read_bytes()
        entries[f"{bundled.dist_info}/METADATA"] = metadata_header(dist, bundled)
    entries["__main__.py"] = MAIN_PY.format(
        min_version=min_version, min_text=f"{min_version[0]}.{min_version[1]}").encode()
    return entries, bundles


def build(output: Path, min_version: tuple[int, int] = SUPPORTED[0],
          timestamp: int | None = None) -> tuple[Path, list[Bundled]]:
    """Write the archive to ``output``; return its path and what went in."""
    if min_version not in SUPPORTED:
        raise PackError(f"--min-python must be one of "
                        f"{', '.join(f'{a}.{b}' for a, b in SUPPORTED)}")
    timestamp = source_date_epoch() if timestamp is None else timestamp
    entries, bundles = archive_entries(min_version)
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


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, tuple[int, int]]:
    parser = argparse.ArgumentParser(
        prog="python -m lowproxy.pack",
        description="Build lowproxy and its runtime dependencies as one zipapp, "
        "run as: python3 -I -S lowproxy.pyz [flags]")
    parser.add_argument("-o", "--output", default=DEFAULT_OUTPUT,
                        help=f"where to write the archive (default {DEFAULT_OUTPUT})")
    parser.add_argument("--min-python", default="3.10",
                        help="oldest Python the archive must run on (default 3.10)")
    parser.add_argument("--print-size", action="store_true",
                        help="print only the archive's size in KiB, as the README states it")
    args = parser.parse_args(argv)
    try:
        major, _, minor = args.min_python.partition(".")
        return args, (int(major), int(minor))
    except ValueError:
        parser.error(f"--min-python: {args.min_python!r} is not like 3.10")


def main(argv: list[str] | None = None) -> int:
    args, min_version = _parse_args(argv)
    try:
        path, bundles = build(Path(args.output), min_version)
    except PackError as exc:
        print(f"lowproxy.pack: {exc}", file=sys.stderr)
        return 1
    data = path.read_bytes()
    if args.print_size:
        print(size_kib(len(data)))
        return 0
    print(f"{path}: {len(data)} bytes ({size_kib(len(data))} KiB), "
          f"sha256 {hashlib.sha256(data).hexdigest()}")
    for bundled in bundles:
        print(f"  {bundled.name} {bundled.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
