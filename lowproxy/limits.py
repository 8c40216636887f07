"""Pure checks on a parsed request head, added to h11's own.

h11 parses what RFC 9112 allows an origin server to accept; a proxy must be
stricter, because a parser on another hop may frame the same bytes
differently (request smuggling). Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import h11

ALLOWED_METHODS = (b"GET", b"POST", b"HEAD", b"OPTIONS")


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    max_connections: int = 10000


# (status, message, error type[, extra headers]): the arguments of a refusal.
Refusal = tuple[Any, ...]


def refusal(event: h11.Request, head_reads: list[bytes], head_size: int,
            limits: Limits) -> Refusal | None:
    """Why a parsed request head is refused; None to serve it."""
    if event.http_version not in (b"1.0", b"1.1"):
        return 505, "HTTP version not supported", "bad_request"
    if event.method not in ALLOWED_METHODS:
        return (405, "method not allowed", "method_not_allowed",
                [(b"allow", b", ".join(ALLOWED_METHODS))])
    if head_size > limits.max_header_bytes:
        return 431, "request header fields too large", "header_too_large"
    declared = None
    chunked = False
    for name, value in event.headers:
        if name == b"content-length":
            declared = int(value)
        elif name == b"transfer-encoding":
            chunked = True
    if declared is not None and chunked:
        # RFC 9112 6.3: a request smuggling vector; h11 would take chunked.
        return 400, "Content-Length with Transfer-Encoding", "bad_request"
    if chunked and event.http_version == b"1.0":
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty
        # framing (a 1.0 hop before us may have framed it otherwise).
        return 400, "Transfer-Encoding in HTTP/1.0", "bad_request"
    problem = head_problem(head_reads, head_size, declared is not None)
    if problem:
        return 400, f"malformed request: {problem}", "bad_request"
    if declared is not None and declared > limits.max_body_bytes:
        return 413, "request body too large", "request_too_large"
    return None


def head_problem(reads: list[bytes], size: int, has_length: bool) -> str | None:
    """What h11 forgives in a request head that a proxy must refuse; None if nothing.

    h11 joins obs-fold continuation lines and merges repeated equal
    Content-Length values. An origin server may (RFC 9112 5.2, RFC 9110 8.6),
    but a proxy refuses both. ``reads`` hold the head in their first ``size``
    bytes.
    """
    head = reads[0] if len(reads) == 1 else b"".join(reads)
    if head.find(b"\n ", 0, size) >= 0 or head.find(b"\n\t", 0, size) >= 0:
        return "obsolete line folding"
    if has_length:
        lowered = head[:size].lower()
        start = lowered.find(b"\ncontent-length:")
        if lowered.find(b"\ncontent-length:", start + 1) >= 0:
            return "repeated Content-Length"
        if b"," in lowered[start:lowered.find(b"\n", start + 1)]:
            return "Content-Length list"
    return None
