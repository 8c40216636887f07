"""bench/soak.py: a 3 s run with every fault kind, and the plumbing of the kinds that
break HTTP framing (the decode gate and the judging), each over real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from soak import generated_twice, summarise
from soak_backends import SO_TIMESTAMPNS, FaultGate, FaultyBackend, GateLink, stray
from soak_client import FAULTS, WIRE_FAULTS, Reply, Soak, chat_body, hostile_usage

from helpers import ROOT, Client, first_reply, wait_until


def test_soak_for_three_seconds(tmp_path):
    """Issue 10's "Done when" in small: every kind played, nothing lost, answered
    wrong or generated twice, descriptors and tasks back at the baseline."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "soak.py"), "--duration", "3",
         "--concurrency", "8", "--report-every", "3", "--loop", "asyncio",
         "--fault-rate", "0.5", "--proxy-log", str(tmp_path / "proxy.log")],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    summary = json.loads(result.stdout.strip().splitlines()[-1])["soak"]
    assert set(summary["faults"]) == set(FAULTS), summary["faults"]  # every kind played
    assert summary["served"] > 0 and summary["failed_as_expected"] > 0
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary["ok"] and summary["proxy_alive"]
    assert summary["lost"] == 0 and summary["unexpected"] == 0
    assert summary["answered_wrong"] == 0 and summary["generated_twice"] == 0
    assert summary["fds_leaked"] <= 0 and summary["tasks_leaked"] <= 0
    # Vanished is not a failure: the client left on purpose, once per such fault.
    assert summary["vanished"] == summary["faults"]["vanish_body"] + \
        summary["faults"]["vanish_stream"]
    assert summary["strays_later"].get("sent", 0) > 0  # the idle-connection stray was tested
    assert summary["proxy_after"]["lowproxy_requests_in_flight"] == 0


@pytest.fixture
async def gate():
    decode = FaultyBackend("decode", record=False)
    await decode.start("127.0.0.1", 0, bootstrap_port=None)
    front = await FaultGate(decode.port).start()
    yield front
    await front.close()
    await decode.close()


def post(fault: str, soak_id: str, stream: bool = False) -> bytes:
    body = chat_body(fault, stream, 4, soak_id)
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gate\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


async def read_until(reader: asyncio.StreamReader, seen: bytes, wanted: bytes) -> bytes:
    while wanted not in seen:
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        assert chunk, f"closed before {wanted!r}; got {seen!r}"
        seen += chunk
    return seen


async def test_gate_writes_a_stray_response_in_the_same_write(gate: FaultGate) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(post("decode_stray_same", "a1"))
    data = await read_until(reader, b"", stray("same", "a1"))
    answer, rest = first_reply(data)
    assert answer.status == 200 and answer.header("x-soak-id") == b"a1"
    assert json.loads(answer.body)["choices"]
    assert rest == stray("same", "a1")  # a whole second response, right after the real one
    # The connection stays open, as a pooled one would: the next request is served.
    writer.write(post("", "a2"))
    data = await read_until(reader, b"", b"x-soak-id: a2")
    writer.close()
    assert gate.received == {"a1": 1, "a2": 1}


async def test_gate_writes_a_stray_response_later_on_the_idle_connection(
        gate: FaultGate) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(post("decode_stray_later", "b1", stream=True))
    data = await read_until(reader, b"", b"0\r\n\r\n")  # the end of the chunked answer
    assert b"x-soak-id: b1" in data and b"data: [DONE]" in data
    later = await read_until(reader, data.split(b"0\r\n\r\n", 1)[1], stray("later", "b1"))
    writer.close()
    assert later == stray("later", "b1")
    await wait_until(lambda: gate.strays == {"sent": 1},  # counted after the grace
                     what="the stray counted as sent on an idle connection")


async def test_gate_sends_no_stray_later_once_the_next_request_is_in(gate: FaultGate) -> None:
    """A stray that reached the proxy after its next request would be that request's
    answer to any HTTP/1.1 client: the gate only sends one on an idle connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(post("decode_stray_later", "f1") + post("", "f2"))  # the next one at once
    data = await read_until(reader, b"", b"x-soak-id: f2")
    data = await read_until(reader, data, b"\r\n0\r\n\r\n") if b"chunked" in data else data
    writer.close()
    assert b"stray" not in data and data.count(b"HTTP/1.1 200 ") == 2
    assert gate.strays == {"skipped": 1}
    assert gate.received == {"f1": 1, "f2": 1}


async def test_gate_swallows_the_request_that_crossed_a_stray(gate: FaultGate,
                                                              monkeypatch) -> None:
    """The proxy's next request arrived while the stray went out (played here: the
    gate saw nothing before the write, and a request from before it after): the
    proxy takes the stray for that request's answer, so the gate leaves it
    unanswered and the next answer is still the next request's own."""
    monkeypatch.setattr(GateLink, "_crossed", lambda self, leaving: True)
    client = await Client.open(gate.port)
    client.writer.write(post("decode_stray_later", "h1"))
    for expected in (b"h1", b"stray-later-h1"):
        client.sent_raw("POST")
        assert (await client.reply(5)).header("x-soak-id") == expected
    client.writer.write(post("", "h2") + post("", "h3"))  # h2 crossed the stray, h3 is next
    client.sent_raw("POST")
    answer = await client.reply(5)
    client.close()
    assert answer.header("x-soak-id") == b"h3"
    assert gate.strays == {"crossed": 1} and gate.crossed == {"stray-later-h1"}
    assert gate.received == {"h1": 1, "h2": 1, "h3": 1}


def test_a_request_crossed_the_stray_only_if_it_arrived_before_it_left() -> None:
    """The gate's judge of a crossing: the kernel's receive time of the proxy's
    bytes against the moment the stray left; peeked, so the request is still read."""
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as proxy:
        gate_side, _ = server.accept()
        with gate_side:
            gate_side.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            link = SimpleNamespace(writer=SimpleNamespace(get_extra_info=lambda _: gate_side))
            assert not GateLink._crossed(link, time.time_ns())  # nothing came
            # Linux turns receive stamps on lazily (a deferred static key): until it
            # has, a packet is stamped when it is read, not when it came. Wait for it.
            for _ in range(200):
                proxy.sendall(b"x")
                select.select([gate_side], [], [], 5)
                stamped = GateLink._crossed(link, time.time_ns())
                assert gate_side.recv(1) == b"x"
                if stamped:
                    break
                time.sleep(0.01)
            before = time.time_ns()
            proxy.sendall(b"POST")
            select.select([gate_side], [], [], 5)
            after = time.time_ns()
            assert GateLink._crossed(link, after)  # it came before the stray left
            assert not GateLink._crossed(link, before)  # the stray left first
            proxy.shutdown(socket.SHUT_WR)
            assert gate_side.recv(10) == b"POST"
            select.select([gate_side], [], [], 5)
            assert not GateLink._crossed(link, time.time_ns())  # a FIN crosses nothing


async def test_gate_hangs_up_after_reading_a_post_and_serves_a_repeat(
        gate: FaultGate) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(post("decode_hangs_up", "c1"))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # not one response byte
    writer.close()
    assert gate.received["c1"] == 1
    # A proxy that sends that POST again reaches a decode that generates again:
    # the soak counts it (generated twice).
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(post("decode_hangs_up", "c1"))
    data = await read_until(reader, b"", b"\r\n\r\n")
    writer.close()
    assert data.startswith(b"HTTP/1.1 200 ")
    assert gate.received["c1"] == 2


async def test_gate_sends_content_length_beside_chunked(gate: FaultGate) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(post("decode_cl_chunked", "d1"))
    data = await read_until(reader, b"", b"\r\n0\r\n\r\n")
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert b"transfer-encoding: chunked" in lines and b"content-length: 10" in lines
    size, _, rest = body.partition(b"\r\n")
    assert int(size, 16) > 10  # the stated length would cut the body
    assert json.loads(rest[:int(size, 16)])["choices"]


def test_judging_tells_a_wrong_answer_from_the_right_one() -> None:
    soak = Soak(type("Args", (), {"faults": list(WIRE_FAULTS), "fault_rate": 1.0})(), 0)
    body = json.dumps({"choices": [{"index": 0}]}).encode()
    mine = [(b"x-soak-id", b"e1"), (b"content-length", b"%d" % len(body))]
    soak.judge(None, Reply(200, body, True, mine), "e1", False)
    assert dict(soak.outcomes) == {"served": 1}
    soak.judge(None, Reply(200, body, True, [(b"x-soak-id", b"stray")]), "e2", False)
    soak.judge(None, Reply(200, body, True, [(b"x-soak-id", b"e1")]), "e3", False)
    soak.judge(None, Reply(200, body, True, []), "e4", False)  # not decode's answer
    soak.judge("decode_cl_chunked", Reply(200, body, True, mine + [
        (b"transfer-encoding", b"chunked")]), "e1", False)
    soak.judge(None, Reply(200, body[:10], True, mine), "e1", False)  # cut, looks complete
    soak.judge(None, Reply(200, b"data: {}\n\n", True, [(b"x-soak-id", b"e5")]), "e5", True)
    assert soak.outcomes["answered wrong"] == 6
    # A stray the gate saw cross the proxy's next request is HTTP/1.1's ambiguity ...
    soak.crossed = {"stray-later-s9"}
    soak.judge(None, Reply(200, body, True, [(b"x-soak-id", b"stray-later-s9")]), "e8", False)
    assert soak.outcomes["crossed a stray"] == 1
    # ... any other stray is the proxy's fault.
    soak.judge(None, Reply(200, body, True, [(b"x-soak-id", b"stray-later-s8")]), "e9", False)
    assert soak.outcomes["answered wrong"] == 7
    soak.judge("decode_hangs_up", Reply(502, b"{}", True, []), "e6", False)
    soak.judge("decode_hangs_up", Reply(200, body, True, [(b"x-soak-id", b"e7")]), "e7", False)
    assert soak.outcomes["failed as expected"] == 1 and soak.outcomes["unexpected"] == 1
    assert soak.bad_by_fault() == {"none": {"answered wrong": 6},
                                   "decode_cl_chunked": {"answered wrong": 1},
                                   "decode_hangs_up": {"unexpected": 1}}


async def test_the_soak_fails_a_proxy_that_sends_a_post_twice(gate: FaultGate) -> None:
    """The old behaviour issue 10 fixed: decode hangs up after reading a POST, and a
    proxy that retries it on a new connection reaches a decode that generates again.
    Played here as that proxy would, against the gate, and judged as the soak does."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(post("decode_hangs_up", "g1"))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up: the proxy retries
    writer.close()
    client = await Client.open(gate.port)
    client.writer.write(post("decode_hangs_up", "g1"))
    client.sent_raw("POST")
    answer = await client.reply(5)
    client.close()
    body = answer.body
    assert (answer.http_version, answer.status) == (b"1.1", 200)  # generated: served again
    soak = Soak(type("Args", (), {"faults": list(WIRE_FAULTS), "fault_rate": 1.0})(), 0)
    soak.judge("decode_hangs_up", Reply(200, body, True, [(b"x-soak-id", b"g1")]), "g1", False)
    prefill = type("Prefill", (), {"received_ids": {}, "fault_of": {}})()
    twice = generated_twice(prefill, gate)
    assert twice == {"decode g1 (decode_hangs_up)": 2}
    state = {"fds": 7, "lowproxy_asyncio_tasks": 3}
    args = type("Args", (), {"kv_protocol": "relay"})()
    summary = summarise(args, soak, 1.0, twice, state, state, True, False)
    assert summary["generated_twice"] == 1 and not summary["ok"]
    assert summary["generated_twice_by_fault"] == {"decode_hangs_up": 1}
    assert summary["bad_by_fault"] == {"decode_hangs_up": {"unexpected": 1}}  # a 200, not 502


def test_hostile_usage_is_judged_by_the_bytes_decode_sent():
    """decode_hostile_usage: a usage the proxy changed is "answered wrong"; the same
    answer with decode's bytes is served."""
    usage = hostile_usage("s6")
    assert "1e400" in usage  # the soak ids cycle through every shape; this one is huge
    sent = (b'{"choices":[{"index":0,"message":{"content":"hostile"}}],"usage":'
            + usage.encode() + b"}")
    changed = sent.replace(b"1e400", b"Infinity")
    soak = Soak(type("Args", (), {"faults": ["decode_hostile_usage"], "fault_rate": 1.0})(), 0)
    headers = [(b"x-soak-id", b"s6")]
    soak.judge("decode_hostile_usage", Reply(200, sent, True, headers), "s6", False)
    soak.judge("decode_hostile_usage", Reply(200, changed, True, headers), "s6", False)
    assert soak.outcomes["served"] == 1 and soak.outcomes["answered wrong"] == 1


def test_a_held_decode_leg_closed_for_its_failed_prefill_is_not_a_second_generation():
    """Under Mooncake the decode leg sent beside a prefill that fails is closed by the
    proxy before decode answers (decode aborts it), and the recompute is the one
    generation; a decode that answered that id twice did generate twice."""
    from collections import Counter
    prefill = SimpleNamespace(received_ids={}, fault_of={})
    gate = SimpleNamespace(received=Counter({"a": 2, "b": 2}), answered=Counter({"a": 1, "b": 2}),
                           fault_of={"a": "prefill_500", "b": "prefill_hang"})
    assert generated_twice(prefill, gate) == {"decode b (prefill_hang)": 2}
