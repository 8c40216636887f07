"""RFC 8259 JSON, strictly: the one parser for a client's body and a backend's answers.

Python's json module takes NaN, Infinity and numbers that overflow to infinity
(json.dumps would then forward them as bare tokens no strict parser reads), and
nests up to about the interpreter's recursion limit, past which json.dumps of a
leg, called from deeper in the stack, would raise RecursionError. Here both are
refused. Pure, no I/O; the callers word the refusal for whoever gets it.
"""

from __future__ import annotations

import json
import math
from itertools import compress
from typing import Any

# 128 is serde_json's default recursion limit; real requests (messages, tool JSON
# schemas) and answers (NIXL's remote_block_ids, a list of lists) nest far less,
# and json.dumps of that depth always succeeds far from the interpreter's limit.
MAX_DEPTH = 128
# Each array or object costs the decoder, the depth walk and every leg's
# serialisation about a microsecond on the event loop: 32 MiB of tiny arrays
# (ten million) held it 9 s. A request's messages, content parts and tool
# schemas, and NIXL's block lists, are thousands. Counted before decoding, as
# brackets anywhere (in strings too): a cheap bound, not an exact count.
MAX_CONTAINERS = 500_000


class NotJson(ValueError):
    """Not RFC 8259 JSON (or not UTF-8)."""


class TooDeep(ValueError):
    """Containers nested deeper than MAX_DEPTH."""


class TooMany(ValueError):
    """More than MAX_CONTAINERS opening brackets."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if math.isinf(number):  # 1e999 reads as inf: no JSON can carry it on (RFC 8259 6)
        raise ValueError("number out of range")
    return number


_CONTAINERS = frozenset((dict, list))
_IS_CONTAINER = _CONTAINERS.__contains__

# Built once: json.loads with hooks builds a decoder and its scanner on every call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def text_of(raw: bytes) -> str:
    """JSON bytes as text, as json.loads decodes them (RFC 8259 8.1, and its BOM rules).

    An object whose second byte is not NUL is UTF-8 by json.detect_encoding's
    own rules (no BOM starts with '{', UTF-16 and UTF-32 put NUL in the first
    two bytes): the common case skips that Python-level function."""
    if raw[:1] == b"{" and raw[1:2] != b"\x00":
        return raw.decode("utf-8", "surrogatepass")
    return raw.decode(json.detect_encoding(raw), "surrogatepass")


def loads(raw: bytes) -> Any:
    """The JSON value in ``raw``; NotJson, TooDeep or TooMany if it is not one to pass on."""
    # C-speed scans: a normal body never pays for the walk, nor a hostile one for
    # decoding millions of containers.
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_CONTAINERS:
        raise TooMany()
    try:
        # What json.loads does with bytes, on the decoder made once.
        value = _DECODER.decode(text_of(raw))
    except RecursionError:
        raise TooDeep() from None
    except ValueError:  # UnicodeDecodeError is a ValueError
        raise NotJson() from None
    # Depth needs at least MAX_DEPTH opening brackets.
    if brackets > MAX_DEPTH and nested_deeper_than(value, MAX_DEPTH):
        raise TooDeep()
    return value


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than ``limit``; iterative, so any depth is safe.

    Level by level, each container's members filtered by C-level iterators
    (compress over their types): a body of a million small messages (32 MiB,
    under the body limit) is walked in well under a second, where a stack of
    (container, depth) pairs built in Python took several, all on the event loop.
    json.loads makes exact dicts and lists, so their types are enough."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 1
    while level:
        if depth > limit:
            return True
        deeper: list[Any] = []
        add = deeper.extend
        for container in level:
            members = container.values() if type(container) is dict else container
            add(compress(members, map(_IS_CONTAINER, map(type, members))))
        level = deeper
        depth += 1
    return False
