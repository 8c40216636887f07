"""Access lines go out in batches, off the path of the next request (issue 21).

A request's line is kept (its fields and time) and made into text when its
batch is written: after ACCESS_FLUSH_SECONDS, at ACCESS_BATCH_LINES, when the
proxy waits for a backend (the upstream pool's wait hook), or when the daemon
stops. Over sockets: the lines of a running daemon all reach its log, in the
order the requests ended, and the last ones are not lost when it stops.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import time

from helpers import CHAT, Daemon, chat, request
from lowproxy.demo import start_pair
from lowproxy.observability import logs
from lowproxy.observability.logs import _AccessWriter


class Stream:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


async def test_a_batch_waits_for_its_timer_then_goes_out_in_one_write(monkeypatch):
    monkeypatch.setattr(logs, "ACCESS_FLUSH_SECONDS", 0.05)
    stream = Stream()
    writer = _AccessWriter(stream, json_format=False)
    writer.write({"request_id": "a"})
    writer.write({"request_id": "b"})
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert stream.writes == []  # not after the loop's turn: the batch waits
    await asyncio.sleep(0.1)
    [text] = stream.writes
    assert text.index("request_id=a") < text.index("request_id=b") and text.endswith("\n")
    assert writer._timer is None  # fired, and nothing armed while nothing is pending


async def test_a_wait_for_a_backend_writes_what_is_pending_and_arms_nothing_more():
    stream = Stream()
    writer = _AccessWriter(stream, json_format=False)
    writer.write({"request_id": "a"})
    timer = writer._timer
    assert timer is not None
    writer.write_pending()
    assert len(stream.writes) == 1 and "request_id=a" in stream.writes[0]
    writer.write_pending()  # nothing pending: no write
    writer.write({"request_id": "b"})
    assert writer._timer is timer  # one timer per batch window, not one per line
    assert len(stream.writes) == 1


async def test_a_full_batch_goes_out_at_once():
    stream = Stream()
    writer = _AccessWriter(stream, json_format=True)
    for n in range(logs.ACCESS_BATCH_LINES):
        writer.write({"method": "POST", "path": "/v1/completions", "status": 200,
                      "request_id": str(n)})
    [text] = stream.writes
    lines = text.splitlines()
    assert len(lines) == logs.ACCESS_BATCH_LINES
    assert [line.count('"request_id"') for line in lines] == [1] * len(lines)


def test_lines_go_out_under_a_later_loop_and_without_one():
    """The loop that armed a batch's timer may close before it fires (asyncio.run
    twice): the next line is not left behind it; with no loop, lines go at once."""
    stream = Stream()
    writer = _AccessWriter(stream, json_format=False)

    async def one_line(tag: str) -> None:
        writer.write({"request_id": tag})

    asyncio.run(one_line("first"))  # its timer dies with its loop, the line pending
    asyncio.run(one_line("second"))
    writer.write({"request_id": "no-loop"})  # none running: written at once, all of it
    text = "".join(stream.writes)
    assert text.index("request_id=first") < text.index("request_id=second") \
        < text.index("request_id=no-loop")


async def test_a_line_carries_the_time_its_request_ended_not_its_write():
    stream = Stream()
    writer = _AccessWriter(stream, json_format=True)
    ended = time.time()
    writer.write({"method": "GET", "path": "/healthz", "status": 200})
    await asyncio.sleep(0.3)
    writer.flush()
    stamp = stream.writes[0].split('"time":"', 1)[1].split('"', 1)[0]
    written = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()
    assert abs(written - ended) < 0.05


# A batch window longer than the test: only a wait for a backend, a full batch or
# the stop writes the daemon's lines.
LONG_WINDOW = ("import sys; from lowproxy.observability import logs; "
               "logs.ACCESS_FLUSH_SECONDS = 3600; from lowproxy.daemon import main; "
               "sys.exit(main())")


async def test_a_daemon_writes_each_line_at_the_next_wait_and_the_last_when_it_stops():
    prefill, decode = await start_pair()
    env = {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0", "PD_PROXY_LOOP": "asyncio",
           "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0", "PD_PROXY_LOG_FORMAT": "json",
           "PD_PROXY_PREFILL_URL": prefill.url, "PD_PROXY_DECODE_URL": decode.url}
    daemon = Daemon([], env, code=LONG_WINDOW)
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        for n in range(4):
            answer = await request(port, "POST", CHAT, chat(user=f"line {n}"),
                                   headers=[("x-request-id", f"batch-{n}")])
            assert answer.status == 200
        assert await asyncio.to_thread(daemon.stop) == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
        await prefill.close()
        await decode.close()
    output = daemon.output()
    ids = re.findall(r'"logger":"lowproxy.access".*?"request_id":"([^"]+)"', output)
    assert ids == [f"batch-{n}" for n in range(4)]  # each once, in order; the last at the stop
    assert output.index('"request_id":"batch-3"') < output.index("drained; exiting")
