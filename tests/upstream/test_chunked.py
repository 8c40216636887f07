"""The chunked-body decoder behind the streaming relay, fed whole and byte by byte."""

from __future__ import annotations

import pytest

from lowproxy.upstream.chunked import ChunkedDecoder, ChunkedError

EVENTS = [b"data: {\"n\": %d}\n\n" % i for i in range(20)]
BODY = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


def decode(wire: bytes, step: int | None = None) -> tuple[bytes, ChunkedDecoder]:
    decoder = ChunkedDecoder()
    out = []
    pieces = [wire] if step is None else [wire[i:i + step] for i in range(0, len(wire), step)]
    for piece in pieces:
        assert not decoder.done
        out.extend(decoder.feed(piece))
    return b"".join(out), decoder


@pytest.mark.parametrize("step", [None, 1, 2, 3, 7, 64])
def test_decodes_whole_and_split_anywhere(step):
    data, decoder = decode(BODY, step)
    assert data == b"".join(EVENTS)
    assert decoder.done and decoder.leftover == b""


def test_each_chunk_comes_out_as_it_arrives():
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5\r\nhel") == [b"hel"]
    assert decoder.feed(b"lo\r\n") == [b"lo"]
    assert not decoder.done
    assert decoder.feed(b"0\r\n\r\n") == []
    assert decoder.done


def test_extensions_and_trailers_are_dropped():
    wire = b"5;name=value\r\nhello\r\n6 ; x\r\n world\r\n0\r\nx-trailer: 1\r\nx-other: 2\r\n\r\n"
    for step in (None, 1):
        data, decoder = decode(wire, step)
        assert data == b"hello world" and decoder.done


def test_uppercase_hex_and_large_chunks():
    payload = bytes(range(256)) * 300
    wire = b"%X\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    data, decoder = decode(wire, 4096)
    assert data == payload and decoder.done


def test_bytes_after_the_body_are_reported():
    data, decoder = decode(b"1\r\na\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert data == b"a" and decoder.done
    assert decoder.leftover == b"HTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize("wire", [
    b"zz\r\nab\r\n",              # not hex
    b"-1\r\na\r\n",               # sign
    b"0x5\r\nhello\r\n",          # prefix int() would take
    b"1_0\r\n",                   # underscore int() would take
    b"\r\n",                      # empty size
    b"5\r\nhelloXX",              # data not followed by CRLF
    b"12345678901234567\r\n",     # more than 64 bits of size
    b"5\nhello\r\n",              # bare LF ends the size line
])
def test_broken_framing_is_an_error(wire):
    with pytest.raises(ChunkedError):
        decode(wire)
    with pytest.raises(ChunkedError):
        decode(wire + b"0\r\n\r\n" * 2000, 1)


def test_endless_size_line_and_trailers_are_bounded():
    with pytest.raises(ChunkedError):
        ChunkedDecoder().feed(b"1" * 5000)
    decoder = ChunkedDecoder()
    decoder.feed(b"0\r\n")
    with pytest.raises(ChunkedError):
        for _ in range(100):
            decoder.feed(b"x-trailer: " + b"a" * 1000 + b"\r\n")
