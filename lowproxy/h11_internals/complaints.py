"""h11's complaints about a peer's bytes, without the bytes.

h11's RemoteProtocolError messages quote the offending line (``illegal header
line: bytearray(b'...')``). Those bytes are the peer's: a backend may reflect
the request's ``authorization`` into a header line, a client's ingress may have
added a secret header. lowproxy writes these messages into log lines and error
bodies, so it keeps h11's words and drops what they quote. The message format
is h11's own, not its API: tests/downstream/test_h11_fence.py pins it.
"""

from __future__ import annotations

_QUOTES = ("bytearray(", "b'", 'b"')


def without_quoted_bytes(message: str, fallback: str) -> str:
    """``message`` up to the first bytes it quotes; ``fallback`` if nothing is left."""
    cut = len(message)
    for quote in _QUOTES:
        found = message.find(quote)
        if 0 <= found < cut:
            cut = found
    return message[:cut].rstrip(": ") or fallback


__all__ = ["without_quoted_bytes"]
