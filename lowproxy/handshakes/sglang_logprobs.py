"""SGLang's /generate with ``return_logprob``: the prompt's logprobs are the prefill's.

A disaggregated decode never runs the prompt (it pulls the KV), so its
``meta_info.input_token_logprobs`` holds none of the prompt's entries; the
prefill computed them. SGLang's own PD routers (mini_lb's ``generate`` and
``generate_stream``, the model gateway's ``merge_logprobs_in_json``) put the
prefill's list in front of decode's, in a whole answer and in every streamed
event; lowproxy does the same. Only an answer that is one object is merged
(a batch's list goes on as decode sent it, as through mini_lb), and only where
decode's answer carries the list itself. Pure functions on bytes.
"""

from __future__ import annotations

from typing import Any

from .._types import Body
from ..routes import SGLANG_GENERATE
from .json_bytes import data_line, finite_json, object_of, skip_space


def wants_merge(surface: str, body: Body) -> bool:
    """Whether this request's answer gets the prefill's prompt logprobs."""
    return surface == SGLANG_GENERATE and bool(body.get("return_logprob"))


def prefill_input_logprobs(raw: bytes) -> list[Any] | None:
    """The prefill answer's ``meta_info.input_token_logprobs``: of its JSON object, or
    of the first event of a streamed answer (where SGLang puts them); else None."""
    text = raw.lstrip()
    if text.startswith(b"data:"):
        text = text[5:].split(b"\n", 1)[0]
    answer = object_of(text)
    return _input_of(answer) if answer is not None else None


def merge_body(raw: bytes, prefix: list[Any]) -> bytes | None:
    """Decode's whole answer with ``prefix`` in front of its prompt logprobs; None to
    relay it as it is (not one object, no such list, not writable as JSON)."""
    answer = object_of(raw)
    if answer is None or not _merge(answer, prefix):
        return None
    return finite_json(answer)


class EncodedPrefix:
    """The prefill's list, its items written once as JSON: every streamed event gets
    them spliced in as bytes. Encoding them per event cost 6 ms an event for a
    10,000-token prompt, on the event loop."""

    __slots__ = ("items", "written")

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        whole = finite_json(items)
        self.written = whole[1:-1] if whole is not None else None  # without [ and ]


_KEY = b'"input_token_logprobs"'


def merge_events(piece: bytes, prefix: EncodedPrefix) -> bytes:
    """Whole lines of a streamed answer, each event's prompt logprobs merged."""
    return merge_some_events(piece, prefix, float("inf"))[0]


def merge_some_events(piece: bytes, prefix: EncodedPrefix, budget: float
                      ) -> tuple[bytes, bytes]:
    """(merged, rest): the events of ``piece`` merged until ``budget`` bytes of them
    are written, and the whole lines after, not merged yet. Every event gets the
    whole list (as SGLang's routers give it): a read of a thousand events merged
    at once, with a long prompt's list, was gigabytes in memory."""
    if piece.find(_KEY) < 0:
        return piece, b""
    lines = piece.split(b"\n")
    written = 0
    for index, line in enumerate(lines):
        if line.startswith(b"data:") and line.find(_KEY) >= 0:
            if written >= budget:
                return b"\n".join(lines[:index]) + b"\n", b"\n".join(lines[index:])
            lines[index] = _merged_line(line, prefix)
            written += len(lines[index])
    return b"\n".join(lines), b""


def _merged_line(line: bytes, prefix: EncodedPrefix) -> bytes:
    """One event's data line merged: by splicing the written prefix where the event
    is certain to hold the list once (its only such key, meta_info's, a list);
    else by writing the event again."""
    event = object_of(line[5:])
    if event is None or _input_of(event) is None:
        return line
    start = line.find(_KEY) + len(_KEY)
    if prefix.written is not None and line.count(_KEY) == 1:
        at = skip_space(line, start)
        if line[at:at + 1] == b":":
            at = skip_space(line, at + 1)
            if line[at:at + 1] == b"[":
                inner = skip_space(line, at + 1)
                if not prefix.written:
                    return line
                joint = b"" if line[inner:inner + 1] == b"]" else b","
                return line[:at + 1] + prefix.written + joint + line[at + 1:]
    if not _merge(event, prefix.items):
        return line
    written = finite_json(event)
    return data_line(written, line) if written is not None else line





def _merge(answer: Body, prefix: list[Any]) -> bool:
    meta = answer.get("meta_info")
    own = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(own, list):
        return False
    meta["input_token_logprobs"] = prefix + own  # type: ignore[index]
    return True


def _input_of(answer: Body) -> list[Any] | None:
    meta = answer.get("meta_info")
    found = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return found if isinstance(found, list) else None





__all__ = ["EncodedPrefix", "merge_body", "merge_events", "merge_some_events",
           "prefill_input_logprobs", "wants_merge"]
