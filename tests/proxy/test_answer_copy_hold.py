"""proxy/answer_copy.py's held lines, on stubs (the socket tests are in
tests/handshakes/test_hostile_usage.py): what a broken-off stream raises while a
line is held, and a long line held in many reads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lowproxy.downstream.messages import ClientGone
from lowproxy.proxy import answer_copy
from lowproxy.proxy.failures import Truncated
from lowproxy.routes import CHAT
from lowproxy.upstream.errors import UpstreamProtocolError


class _Histogram:
    def observe(self, *args: Any) -> None:
        pass


class _Responder:
    def __init__(self, gone_after: int | None = None) -> None:
        self.out: list[bytes] = []
        self.gone_after = gone_after

    async def start(self, status: int, headers: Any, length: Any) -> None:
        pass

    def relay(self, pieces: list[bytes]) -> bool:
        if self.gone_after is not None and len(self.out) >= self.gone_after:
            raise ClientGone()
        self.out.append(b"".join(pieces))
        return False

    async def end(self) -> None:
        pass

    async def wait_for_client(self) -> None:
        pass


class _Response:
    status = 200

    def __init__(self, reads: list[bytes], error: Exception | None = None) -> None:
        self.reads, self.error = reads, error
        self.headers = [(b"content-type", b"text/event-stream"),
                        (b"transfer-encoding", b"chunked")]
        self.endpoint = SimpleNamespace(label="decode:1")

    async def deliver_body(self, deliver: Any, wait: Any) -> None:
        for read in self.reads:
            deliver([read])
        if self.error is not None:
            raise self.error


def _exchange() -> Any:
    return SimpleNamespace(wants_stream=True, prefill_cached_tokens=3, surface=CHAT,
                           prefill_input_logprobs=None, first_byte_ms=None,
                           elapsed_ms=lambda: 1.0)


METRICS: Any = SimpleNamespace(decode_first_byte=_Histogram(),
                               decode_legs=SimpleNamespace(inc=lambda *a: None))


async def test_a_break_off_while_a_line_is_held_is_told_even_if_the_client_left():
    """The break-off is what goes up (a 502 in the logs, decode named), not the
    ClientGone the held line's last write met."""
    response = _Response([b'data: {"a":1}\n\n', b'data: {"partial'],
                         UpstreamProtocolError("decode:1 broke off", None))
    with pytest.raises(Truncated):
        await answer_copy.relay(METRICS, _exchange(), _Responder(gone_after=1), response)


def test_a_long_line_held_over_many_reads_goes_out_whole_and_once():
    line = b"data: " + b"x" * (1024 * 1024) + b"\n\n"
    responder = _Responder()
    delivery = answer_copy._Delivery(_exchange(), responder, _Histogram(), CHAT, 3)
    for start in range(0, len(line), 16 * 1024):
        delivery.deliver([line[start:start + 16 * 1024]])
    delivery.release()
    assert responder.out == [line]
    assert delivery.held == [] and delivery.held_bytes == 0


def test_a_line_beyond_the_bound_goes_on_as_it_comes(monkeypatch):
    monkeypatch.setattr(answer_copy, "MAX_HELD_LINE_BYTES", 100)
    responder = _Responder()
    delivery = answer_copy._Delivery(_exchange(), responder, _Histogram(), CHAT, 3)
    for _ in range(3):
        delivery.deliver([b"y" * 60])  # no newline: held while within 100 bytes
    assert b"".join(responder.out) + b"".join(delivery.held) == b"y" * 180
    assert delivery.held_bytes <= 100


async def test_sglang_logprobs_are_merged_a_budget_at_a_time(monkeypatch):
    """Every event gets the prefill's whole list: a read of many events is merged a
    budget at a time, the rest waiting until the client took what went before (one
    read of a thousand events with a long prompt's list was gigabytes at once)."""
    from lowproxy.handshakes.sglang_logprobs import EncodedPrefix, merge_events
    monkeypatch.setattr(answer_copy, "MERGE_BUDGET_BYTES", 100_000)
    prefix = EncodedPrefix([[-1.5, index, None] for index in range(2000)])  # ~34 KB
    event = b'data: {"meta_info":{"input_token_logprobs":[]}}\n\n'
    read = event * 50 + b"data: [DONE]\n\n"
    responder = _Responder()
    delivery = answer_copy._Delivery(_exchange(), responder, _Histogram(), CHAT, 3, prefix)
    assert delivery.deliver([read]) is True  # slow: reading pauses, the rest waits
    assert len(responder.out) == 1 and len(responder.out[0]) < 100_000 + 40_000
    await delivery.wait()
    assert delivery.pending == []
    assert b"".join(responder.out) == merge_events(read, prefix)
    assert all(len(out) < 140_000 for out in responder.out)


def test_a_stream_whose_lines_end_with_cr_alone_is_not_held():
    """SSE lets a bare CR end a line: such a stream goes on read by read."""
    responder = _Responder()
    delivery = answer_copy._Delivery(_exchange(), responder, _Histogram(), CHAT, 3)
    delivery.deliver([b'data: {"a":1}\r\r'])
    delivery.deliver([b'data: {"b"'])
    delivery.deliver([b':2}\r\r'])
    assert responder.out == [b'data: {"a":1}\r\r', b'data: {"b":2}\r\r']


def test_a_rewritten_event_keeps_its_cr_line_ends():
    """JSON takes a trailing CR as space: written again, the event keeps it, or it
    would run into the next one (and [DONE] would be lost to an SSE parser)."""
    from lowproxy.handshakes.sglang_logprobs import EncodedPrefix, merge_events
    from lowproxy.handshakes.usage import rewrite_events
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":10}}\r'
    out = rewrite_events(CHAT, usage + b"\n\r\n", 3)
    assert out.endswith(b'"cached_tokens":3}}}\r\n\r\n'), out
    twice = b'data: {"meta_info":{"input_token_logprobs":[]},"x":"input_token_logprobs"}\r\r'
    assert merge_events(twice, EncodedPrefix([1])).endswith(b'"x":"input_token_logprobs"}\r\r')
