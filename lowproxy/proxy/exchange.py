"""The record of one client request: its ids, timings and the choices made for it.

Filled in as the request goes through routing and dispatch, read by the
access line, the metrics and the spans. It holds no body and no I/O object.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .._types import Headers
from ..downstream.messages import ClientRequest
from ..routing.prefill import PrefillLease
from ..upstream.endpoint import Endpoint


class PrefillLeg(enum.Enum):
    """Where the request's prefill leg is; dispatch reports its end once."""

    NOT_SENT = "not sent"  # none yet (decode only, skipped, or still planning)
    RUNNING = "running"
    ENDED = "ended"  # reported: the leg is over, or none will be sent


@dataclass(slots=True, eq=False)
class Exchange:
    request: ClientRequest
    route: str
    request_id: str
    upstream_headers: Headers  # the client's end-to-end headers, as both legs get them
    trace_id: str | None = None
    span: Any = None  # the OpenTelemetry server span, when tracing is on
    started: float = field(default_factory=time.perf_counter)
    started_ns: int = field(default_factory=time.time_ns)
    decode_started: float | None = None
    handshake: str | None = None
    prefill_ms: float | None = None
    first_byte_ms: float | None = None
    decode_backend: str | None = None
    prefill_backend: str | None = None
    wants_stream: bool = False
    skip_reason: str | None = None  # why the prefill leg was skipped, when it was
    decode_endpoint: Endpoint | None = None  # where the decode leg went
    decode_preferred: Endpoint | None = None  # the decode cache-aware routing chose, if any
    surface: str | None = None  # the generation surface (routes.CHAT, ...), if one
    model: str | None = None  # the model a generation request names (routes its legs)
    prefill_cached_tokens: int | None = None  # the prefill's figure, for decode's usage
    prefill_input_logprobs: list[Any] | None = None  # SGLang's, for decode's answer
    prefill_lease: PrefillLease | None = None  # the prefill choice, released at the leg's end
    prefill_leg: PrefillLeg = PrefillLeg.NOT_SENT
    # Responses: the placeholder request_id in decode's body, replaced by an id that
    # names the decode each leg goes to (routing/response_homes.py); None elsewhere.
    response_slot: bytes | None = None

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0
