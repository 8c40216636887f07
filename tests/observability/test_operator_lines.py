"""What an operator reads: build info, which worker wrote a line, start errors as JSON,
and why a prefill endpoint was chosen when there was only one."""

from __future__ import annotations

import asyncio
import json
import platform
import re
import socket

from helpers import CHAT, Daemon, chat, pd_setup, request
from lowproxy import __version__
from lowproxy.demo import start_pair
from lowproxy.observability.logs import _AccessWriter

BASE = {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0", "PD_PROXY_LOOP": "asyncio",
        "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0"}


def samples(page: bytes, name: str) -> list[str]:
    return re.findall(rf"^{name}(?:\{{[^}}]*\}})? .*$", page.decode(), re.M)


async def test_build_info_and_the_one_prefill_reason():
    async with pd_setup(prefill_policy="affinity") as (running, prefill, _):
        for n in range(3):
            body = chat(messages=[{"role": "user", "content": f"prompt {n}"}])
            assert (await running.request("POST", CHAT, body)).status == 200
        page = (await running.request("GET", "/metrics")).body
        assert samples(page, "lowproxy_build_info") == [
            f'lowproxy_build_info{{version="{__version__}",'
            f'python="{platform.python_version()}",loop="asyncio"}} 1']
        # One prefill endpoint: nothing was chosen, neither by prefix nor by load.
        assert samples(page, "lowproxy_prefill_choice_total") == [
            'lowproxy_prefill_choice_total{reason="only"} 3']
        assert len(prefill.requests_to(CHAT)) == 3


async def test_access_lines_say_which_worker_wrote_them():
    prefill, decode = await start_pair()
    daemon = Daemon(["--workers", "2", "--prefill", prefill.url, "--decode", decode.url],
                    BASE)
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        assert await asyncio.to_thread(daemon.wait_listening) == port  # the second worker
        for _ in range(4):
            assert (await request(port, "POST", CHAT, chat())).status == 200
        page = (await request(port, "GET", "/metrics")).body
        # Summed over both workers, the build is still one build.
        [build] = samples(page, "lowproxy_build_info")
        assert build.endswith(" 1")
        assert await asyncio.to_thread(daemon.stop) == 0
        access = [line for line in daemon.output().splitlines() if "[lowproxy.access]" in line]
        assert len(access) == 4, daemon.output()
        assert all(re.search(r"\] worker=[01] request_id=", line) for line in access), access
        listening = [line for line in daemon.lines if "listening on" in line]
        assert sorted(re.search(r"worker=(\d)", line).group(1) for line in listening) == \
            ["0", "1"]
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
        await prefill.close()
        await decode.close()


async def test_json_access_lines_carry_the_worker():
    prefill, decode = await start_pair()
    daemon = Daemon(["--workers", "2", "--log-format", "json", "--decode", decode.url], BASE)
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        await asyncio.to_thread(daemon.wait_listening)
        assert (await request(port, "POST", CHAT, chat())).status == 200
        assert await asyncio.to_thread(daemon.stop) == 0
        entries = [json.loads(line) for line in daemon.output().splitlines() if line.strip()]
        [access] = [e for e in entries if e["logger"] == "lowproxy.access"]
        assert access["worker"] in (0, 1) and access["status"] == 200
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
        await prefill.close()
        await decode.close()


def test_start_errors_are_one_json_line_under_json_logs():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for env in ({"PD_PROXY_PORT": str(port)},  # found at start: the port is taken
                    {"PD_PROXY_DRAIN_SECONDS": "soon"}):  # a value that does not parse
            daemon = Daemon([], {**BASE, "PD_PROXY_LOG_FORMAT": "json", **env})
            assert daemon.proc.wait(30) == 2
            [line] = [line for line in daemon.output().splitlines() if line.strip()]
            entry = json.loads(line)
            assert entry["level"] == "error" and entry["exit_status"] == 2
            setting = "PD_PROXY_PORT" if "PD_PROXY_PORT" in env else "PD_PROXY_DRAIN_SECONDS"
            assert setting in entry["message"]


def test_access_lines_of_one_loop_turn_go_out_in_one_write_on_each_loop_in_turn():
    """The writer remembers the running loop (3.11's get_running_loop costs a getpid()
    each call): lines written under a later loop still go out, and without a loop at once."""
    class Stream:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    stream = Stream()
    writer = _AccessWriter(stream, json_format=False)

    async def two_lines(tag: str) -> None:
        writer.write({"request_id": f"{tag}-1"})
        writer.write({"request_id": f"{tag}-2"})
        assert not any(tag in text for text in stream.writes)  # not yet: after the turn
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(two_lines("first"))
    asyncio.run(two_lines("second"))  # a new loop: the remembered one is closed
    writer.write({"request_id": "no-loop"})  # none running: written at once
    assert len(stream.writes) == 3
    assert "request_id=first-1" in stream.writes[0] and "request_id=first-2" in stream.writes[0]
    assert "request_id=second-1" in stream.writes[1] and "request_id=second-2" in stream.writes[1]
    assert "request_id=no-loop" in stream.writes[2]
