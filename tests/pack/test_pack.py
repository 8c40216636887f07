"""The single-file build: python -m lowproxy.pack, then python3 -I -S lowproxy.pyz.

The archive is built in a temporary directory and run with nothing on the
path but itself, on every CPython 3.10-3.13 this machine has, through real
requests to demo backends started here.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import shutil
import ssl
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from helpers import ROOT, Daemon, chat, request
from lowproxy import __version__
from lowproxy.demo import start_pair
from lowproxy.pack import DEFAULT_OUTPUT, size_kib
from lowproxy.pack.markers import (
    PackError,
    marker_applies,
    normalize,
    parse_requirement,
    target_environment,
)
from lowproxy.pack.sources import ROOT_REQUIREMENTS, SUPPORTED, needed_distributions

ONE_MIB = 1024 * 1024


def pack(output: Path, epoch: str | None = None, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    env["PYTHONPATH"] = ROOT
    if epoch is not None:
        env["SOURCE_DATE_EPOCH"] = epoch
    return subprocess.run([sys.executable, "-m", "lowproxy.pack", "-o", str(output), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("pack") / "dist" / "lowproxy.pyz"
    built = pack(output)
    assert built.returncode == 0, built.stderr
    assert f"{output}: " in built.stdout
    return output


def find_python(minor: int) -> str | None:
    """A working python3.N: PATH (pyenv shims may exist but refuse), then pyenv's versions."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which(f"python3.{minor}")]
    candidates += sorted(glob.glob(f"{root}/versions/3.{minor}.*/bin/python3.{minor}"))
    candidates += [f"/usr/bin/python3.{minor}", f"/usr/local/bin/python3.{minor}"]
    for candidate in candidates:
        if not candidate or not os.path.exists(candidate):
            continue
        try:
            probe = subprocess.run([candidate, "-I", "-S", "-c",
                                    "import sys; print(sys.version_info[:2])"],
                                   capture_output=True, text=True, timeout=20)
        except OSError:
            continue
        if probe.returncode == 0 and probe.stdout.strip() == f"(3, {minor})":
            return candidate
    return None


OTHER_MINORS = [minor for minor in range(10, 14) if (3, minor) != sys.version_info[:2]]
INTERPRETERS = ["running"] + [f"3.{minor}" for minor in OTHER_MINORS]


def interpreter(which: str) -> str:
    if which == "running":
        return sys.executable
    found = find_python(int(which.split(".")[1]))
    if found is None:
        pytest.skip(f"no python{which} interpreter on this machine")
    return found


class PyzDaemon(Daemon):
    """The single file as a child process, with no site-packages and no PYTHON* variables."""

    def __init__(self, python: str, pyz: Path, args: list[str], env: dict[str, str]) -> None:
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("PD_PROXY_", "ADMIN_API_KEY", "PYTHON"))}
        full_env.update(env)
        self.proc = subprocess.Popen([python, "-I", "-S", str(pyz), *args], env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=pyz.parent)
        self.port = 0
        self.lines = []


def run_pyz(python: str, pyz: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PD_PROXY_", "PYTHON"))}
    return subprocess.run([python, "-I", "-S", str(pyz), *args], env=env, cwd=pyz.parent,
                          capture_output=True, text=True, timeout=30)


# -- the archive itself


def test_size_fits_a_configmap(pyz: Path) -> None:
    size = pyz.stat().st_size
    print(f"lowproxy.pyz: {size} bytes")
    assert 0 < size < ONE_MIB


def test_build_is_byte_for_byte_reproducible(pyz: Path, tmp_path: Path) -> None:
    again = tmp_path / "elsewhere" / "lowproxy.pyz"
    assert pack(again).returncode == 0
    assert again.read_bytes() == pyz.read_bytes()
    # A different SOURCE_DATE_EPOCH is the only thing that changes the bytes.
    later = tmp_path / "later.pyz"
    assert pack(later, "1700000000").returncode == 0
    assert later.read_bytes() != pyz.read_bytes()
    with zipfile.ZipFile(later) as archive:
        assert {info.date_time for info in archive.infolist()} == {(2023, 11, 14, 22, 13, 20)}


def test_contents_fixed_metadata_and_no_bytecode(pyz: Path) -> None:
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(pyz) as archive:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        assert archive.testzip() is None
    assert names == sorted(names)
    assert {info.date_time for info in infos} == {(1980, 1, 1, 0, 0, 0)}  # epoch unset
    assert {info.external_attr >> 16 for info in infos} == {0o100644}
    assert {info.compress_type for info in infos} == {zipfile.ZIP_DEFLATED}
    assert "__main__.py" in names and "lowproxy/daemon.py" in names
    assert "lowproxy/handshakes/mooncake.py" in names
    # The build tool (lowproxy/pack/) stays out of the build.
    assert not [n for n in names if n.startswith("lowproxy/pack")]
    assert "lowproxy/pack/sources.py" not in names
    assert not [n for n in names if n.endswith((".pyc", ".pyo")) or "__pycache__" in n]
    assert not [n for n in names if "/tests/" in n or n.startswith("tests/")]
    for package in ("h11/", "httpcore/", "anyio/", "idna/", "certifi/", "exceptiongroup/"):
        assert any(n.startswith(package) for n in names), package
    assert "typing_extensions.py" in names
    assert "certifi/cacert.pem" in names


def test_every_bundled_distribution_carries_its_license(pyz: Path) -> None:
    with zipfile.ZipFile(pyz) as archive:
        names = archive.namelist()
        dist_infos = sorted({n.split("/")[0] for n in names if ".dist-info/" in n})
        assert len(dist_infos) >= 8
        for dist_info in dist_infos:
            licenses = [n for n in names if n.startswith(f"{dist_info}/licenses/")]
            assert licenses, f"{dist_info} has no license file"
            assert all(archive.read(n).strip() for n in licenses)
            metadata = archive.read(f"{dist_info}/METADATA").decode()
            assert metadata.startswith("Metadata-Version:") and "\nVersion: " in metadata
        lowproxy_license = archive.read(f"lowproxy-{__version__}.dist-info/licenses/LICENSE")
    assert lowproxy_license == (Path(ROOT) / "LICENSE").read_bytes()


def test_default_output_is_what_the_dockerfile_copies() -> None:
    assert DEFAULT_OUTPUT == "dist/lowproxy.pyz"


def test_missing_dependency_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(PackError, match="pip install 'no-such-dist-for-lowproxy'"):
        needed_distributions(roots=("no-such-dist-for-lowproxy>=1",))


def test_bad_source_date_epoch_is_refused(tmp_path: Path) -> None:
    built = pack(tmp_path / "x.pyz", "yesterday")
    assert built.returncode == 1
    assert "SOURCE_DATE_EPOCH" in built.stderr
    assert not (tmp_path / "x.pyz").exists()


# -- which dependencies


def declared_dependencies() -> list[str]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the stdlib from 3.11")
    with open(Path(ROOT) / "pyproject.toml", "rb") as handle:
        return list(tomllib.load(handle)["project"]["dependencies"])


def test_root_requirements_are_declared_in_pyproject() -> None:
    assert set(ROOT_REQUIREMENTS) <= set(declared_dependencies())


def installed_by_plain_install(requirements: list[str]) -> set[str]:
    """What ``pip install .`` brings for the running Python: pyproject's dependencies
    followed through installed metadata, markers evaluated for this interpreter only
    (pip does not install what a marker limits to other Python versions)."""
    here = target_environment(sys.version_info[:2])
    wanted = [parse_requirement(text) for text in requirements]
    found: set[str] = set()
    while wanted:
        requirement = wanted.pop()
        if requirement.name in found:
            continue
        found.add(requirement.name)
        for text in metadata.distribution(requirement.name).requires or ():
            child = parse_requirement(text)
            if marker_applies(child.marker, here, requirement.extras):
                wanted.append(child)
    return found


def test_plain_install_brings_everything_the_build_bundles() -> None:
    """``python -m lowproxy.pack`` right after ``pip install .`` on any supported Python:
    whatever the archive bundles for some 3.10-3.13 target must be a dependency pip
    installs here too. exceptiongroup is the case in point: anyio needs it on 3.10
    only, so a 3.11+ interpreter gets it only if lowproxy declares it unconditionally."""
    missing = set(needed_distributions()) - installed_by_plain_install(declared_dependencies())
    assert not missing, (f"pip install . on {sys.version.split()[0]} would not install "
                         f"{sorted(missing)}, which the build bundles: declare them in "
                         "pyproject.toml [project] dependencies")


def readme_size_kib() -> int:
    text = (Path(ROOT) / "README.md").read_text()
    found = re.findall(r"zipapp \(about (\d+) KiB", text)
    assert len(found) == 1, "the README states the archive size once, as 'zipapp (about N KiB'"
    return int(found[0])


# How far the README's figure may drift before the test asks for a new one: every
# change to lowproxy moves the size a little; a growth past this is news to tell.
README_SIZE_TOLERANCE = 0.04


def test_readme_states_the_size_the_build_makes(pyz: Path) -> None:
    stated, built = readme_size_kib(), size_kib(pyz.stat().st_size)
    assert abs(stated - built) <= README_SIZE_TOLERANCE * built, (
        f"README.md says the archive is about {stated} KiB, the build makes {built} KiB: "
        f"update the figure from `python -m lowproxy.pack --print-size`")
    assert built * 1024 < ONE_MIB  # and the README's "under a ConfigMap's 1 MiB" holds


def test_print_size_is_the_figure_the_readme_uses(tmp_path: Path) -> None:
    output = tmp_path / "sized.pyz"
    done = pack(output, None, "--print-size")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{size_kib(output.stat().st_size)}\n"
    assert size_kib(1535) == 1 and size_kib(1536) == 2 and size_kib(555337) == 542


def test_dependencies_cover_every_supported_python() -> None:
    everywhere = needed_distributions()
    assert {"h11", "httpcore", "anyio", "idna", "certifi", "typing-extensions",
            "exceptiongroup"} <= set(everywhere)
    # exceptiongroup is only for 3.10 (anyio's marker), wherever the build runs.
    from_311 = needed_distributions(versions=[v for v in SUPPORTED if v >= (3, 11)])
    assert "exceptiongroup" not in from_311
    assert "trio" not in everywhere  # httpcore's other extras stay out


def test_markers() -> None:
    py310, py311 = target_environment((3, 10)), target_environment((3, 11))
    assert marker_applies('python_version < "3.11"', py310, ())
    assert not marker_applies('python_version < "3.11"', py311, ())
    assert marker_applies("python_version >= '3.10' and sys_platform == 'linux'", py310, ())
    assert not marker_applies('extra == "trio"', py311, ())
    assert marker_applies('extra == "asyncio"', py311, {"asyncio"})
    assert marker_applies('(extra == "x" or python_version <= "3.10") and os_name == "posix"',
                          py310, ())
    assert marker_applies('python_full_version >= "3.10.0"', py310, ())
    with pytest.raises(PackError, match="platform_machine"):
        marker_applies('platform_machine == "x86_64"', py310, ())
    requirement = parse_requirement("httpcore[asyncio] >=1.0.5,<2 ; python_version >= '3.8'")
    assert requirement.name == "httpcore" and requirement.extras == {"asyncio"}
    assert requirement.marker == "python_version >= '3.8'"
    assert normalize("Typing_Extensions") == "typing-extensions"


# -- running it with nothing installed


@pytest.mark.parametrize("which", INTERPRETERS)
def test_version_from_the_single_file(pyz: Path, which: str) -> None:
    python = interpreter(which)
    done = run_pyz(python, pyz, "--version")
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    assert text.startswith(f"lowproxy {__version__}, h11 ")
    for name in ("httpcore", "anyio"):
        assert f"{name} " in text
    assert "anyio 4." in text or "anyio 5." in text  # a version, read from bundled metadata
    assert text.endswith("single file")  # imported from the archive, not from the repo


@pytest.mark.parametrize("which", INTERPRETERS)
async def test_single_file_proxies_a_real_request(pyz: Path, which: str) -> None:
    python = interpreter(which)
    prefill, decode = await start_pair()
    daemon = PyzDaemon(python, pyz, [], {
        "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0",
        "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0",  # the backends see the legs alone
        "PD_PROXY_PREFILL_URL": prefill.url, "PD_PROXY_DECODE_URL": decode.url,
    })
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        health = await request(port, "GET", "/healthz")
        assert health.status == 200
        ready = await request(port, "GET", "/readyz")
        assert ready.status == 200, ready.body
        reply = await request(port, "POST", "/v1/chat/completions", chat())
        assert reply.status == 200, reply.body
        assert reply.json()["choices"]
        # Both legs happened: prefill first, then decode with its KV parameters.
        assert [r.path for r in prefill.received] == ["/v1/chat/completions"]
        assert [r.path for r in decode.received] == ["/v1/chat/completions"]
        assert decode.received[0].body.get("kv_transfer_params")
        streamed = await request(port, "POST", "/v1/chat/completions", chat(stream=True))
        assert streamed.status == 200 and streamed.complete
        assert streamed.body.rstrip().endswith(b"data: [DONE]")
    finally:
        status = await asyncio.to_thread(daemon.stop)
        await prefill.close()
        await decode.close()
    assert status == 0, daemon.output()
    assert "drained" in daemon.output()


async def test_single_file_reaches_an_https_backend_with_a_ca_file(pyz: Path,
                                                                    tmp_path: Path) -> None:
    """TLS from the archive: the CA file is loaded and a verified connection made."""
    trustme = pytest.importorskip("trustme", reason="trustme is in the test extra only")
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        seen.append(head.split(b"\r\n")[0])
        body = b'{"id":"x","object":"chat.completion","choices":[]}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=server_context)
    backend_port = server.sockets[0].getsockname()[1]
    daemon = PyzDaemon(sys.executable, pyz, [], {
        "PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0",
        "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0",  # the backends see the legs alone
        "PD_PROXY_DECODE_URL": f"https://localhost:{backend_port}",
        "PD_PROXY_CA_FILE": str(ca_file),
    })
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        reply = await request(port, "POST", "/v1/chat/completions", chat())
        assert reply.status == 200, reply.body
        assert reply.json()["id"] == "x"
        assert seen == [b"POST /v1/chat/completions HTTP/1.1"]
    finally:
        await asyncio.to_thread(daemon.stop)
        server.close()
        await server.wait_closed()


def test_single_file_refuses_a_missing_ca_file(pyz: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PD_PROXY_", "PYTHON"))}
    env.update({"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0",
                "PD_PROXY_CA_FILE": str(tmp_path / "absent.pem")})
    done = subprocess.run([sys.executable, "-I", "-S", str(pyz)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2  # a start mistake (issue 13): one line, status 2
    assert "absent.pem" in done.stderr


def test_certifi_works_from_the_archive(pyz: Path) -> None:
    """httpcore imports certifi at import time; its bundle must be usable from the zip."""
    code = ("import sys, os; sys.path.insert(0, sys.argv[1]); import certifi, httpcore; "
            "from httpcore._ssl import default_ssl_context; default_ssl_context(); "
            "print(certifi.__file__); print(os.path.getsize(certifi.where()))")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(pyz)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    origin, size = done.stdout.split()
    assert origin.startswith(str(pyz))
    assert int(size) > 10000


def test_too_old_python_gets_a_clear_message(tmp_path: Path) -> None:
    pyz = tmp_path / "new.pyz"
    assert pack(pyz, None, "--min-python", "3.13").returncode == 0
    if sys.version_info >= (3, 13):
        pytest.skip("the running interpreter is 3.13: nothing older to try")
    done = run_pyz(sys.executable, pyz, "--version")
    assert done.returncode == 1
    assert "needs Python 3.13 or newer" in done.stderr
    with zipfile.ZipFile(pyz) as archive:
        assert not [n for n in archive.namelist() if n.startswith("exceptiongroup")]
