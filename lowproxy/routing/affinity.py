"""Prefill affinity, pure: a request's prefix key and size, a stable hash ring, bounded loads.

The prefix key is what requests sharing a prompt prefix have in common, so that
they reach the prefill endpoint whose prefix cache already holds it:

- chat and Messages: the system prompt (``system`` / the leading system and
  developer messages) and the conversation's first user turn, each as
  ``role NUL text SOH``; later turns extend the same conversation, whose
  prefix this already identifies;
- Responses: ``instructions`` and the input items up to the first user item;
- completions: the prompt's first bytes (token-id prompts: the first ids);
- generate: the first token ids.

Only the first PREFIX_KEY_BYTES bytes of that text count: requests sharing
that many bytes share at least that much cached prefix, and hashing a 100 kB
system prompt on every request would cost more than it tells. No key (an
unknown shape): the request is placed by load alone.

The hash is blake2b of the key (never Python's ``hash()``, which differs per
process), and the ring's points are blake2b of the endpoint names, so replicas
configured with the same backends place a prefix on the same endpoint without
sharing any state. Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016): a key
goes to the first endpoint clockwise whose outstanding work, with this
request's, stays within (1 + slack) times the average; an endpoint leaving the
ring moves only the keys it held.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any, Collection, Iterator, Mapping, NamedTuple, Sequence

from .prompts import Conversation, message_text, prompt_of

PREFIX_KEY_BYTES = 4096
TOKEN_ID_BYTES = 4  # a token-id prompt counts this many bytes per id (about one token of text)
VIRTUAL_NODES = 64  # ring points per endpoint: spreads the keys evenly over few endpoints
_LEADING_ROLES = frozenset({"system", "developer"})


class PromptFacts(NamedTuple):
    key: bytes | None  # the prefix key; None: no affinity for this request
    size: int | None   # prompt text in UTF-8 bytes; None: not measurable


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that every process and host computes alike."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def utf8_len(text: str) -> int:
    # str.isascii() reads a flag CPython keeps: no scan for the common case.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class _Key:
    """The prefix key, built piece by piece up to PREFIX_KEY_BYTES."""

    __slots__ = ("parts", "room")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.room = PREFIX_KEY_BYTES

    def add(self, role: str, text: str) -> None:
        if self.room <= 0:
            return
        # A character is at least one byte: slicing by characters first bounds the work.
        piece = f"{role}\0{text[:self.room]}\1".encode("utf-8", "surrogatepass")[:self.room]
        self.parts.append(piece)
        self.room -= len(piece)

    def value(self) -> bytes | None:
        return b"".join(self.parts) if self.parts else None


def _conversation(system: Any, messages: Any) -> PromptFacts:
    """chat, Messages and Responses input: leading system text and the first user turn."""
    key = _Key()
    size = 0
    if system is not None:
        text = message_text(system)
        key.add("system", text)
        size += utf8_len(text)
    if not isinstance(messages, list):
        return PromptFacts(key.value(), size if system is not None else None)
    keyed = True
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        role = role if isinstance(role, str) else ""
        text = message_text(message.get("content"))
        size += utf8_len(text)
        if keyed:
            key.add(role, text)
            keyed = role in _LEADING_ROLES  # up to and including the first other turn
    return PromptFacts(key.value(), size)


def _token_ids(ids: list[Any]) -> PromptFacts:
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
        return PromptFacts(None, None)
    first = ids[:PREFIX_KEY_BYTES // TOKEN_ID_BYTES]
    key = b"ids\0" + b"".join((token % 2**32).to_bytes(4, "big") for token in first)
    return PromptFacts(key, TOKEN_ID_BYTES * len(ids))


def prompt_facts(surface: str, body: Mapping[str, Any]) -> PromptFacts:
    """The prefix key and prompt size of a generation request (routes.py surfaces)."""
    prompt = prompt_of(surface, body)
    if isinstance(prompt, Conversation):
        return _conversation(prompt.system, prompt.messages)
    if isinstance(prompt, str):
        key = _Key()
        key.add("prompt", prompt)
        return PromptFacts(key.value(), utf8_len(prompt))
    if isinstance(prompt, list):
        return _token_ids(prompt)
    return PromptFacts(None, None)  # several prompts: never handed off anyway


class Ring:
    """Endpoint names on a hash ring, VIRTUAL_NODES points each."""

    __slots__ = ("names", "_hashes", "_owners")

    def __init__(self, names: Sequence[str], vnodes: int = VIRTUAL_NODES) -> None:
        self.names = tuple(sorted(set(names)))
        points = sorted((stable_hash(f"{name}#{index}".encode()), name)
                        for name in self.names for index in range(vnodes))
        self._hashes = [point for point, _ in points]
        self._owners = [name for _, name in points]

    def order(self, key_hash: int) -> Iterator[str]:
        """Every name once, clockwise from ``key_hash``."""
        count = len(self._hashes)
        start = bisect.bisect_left(self._hashes, key_hash)
        seen: set[str] = set()
        for offset in range(count):
            name = self._owners[(start + offset) % count]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == len(self.names):
                    return


def choose_bounded(ring: Ring, key_hash: int, eligible: Collection[str],
                   loads: Mapping[str, float], cost: float, slack: float
                   ) -> tuple[str, bool] | None:
    """(name, at home) for a key: the first eligible name clockwise within the bound.

    The bound is (1 + slack) x the average outstanding work of the eligible
    names, this request included. "At home" says the key's first eligible name
    took it; False means bounded loads sent it on. An idle endpoint always
    takes its keys; otherwise a prompt too large for any
    endpoint's room goes to the least loaded.
    """
    if not eligible:
        return None
    cost = max(cost, 1.0)
    total = sum(loads.get(name, 0.0) for name in eligible)
    capacity = (1.0 + slack) * (total + cost) / len(eligible)
    home = None
    for name in ring.order(key_hash):
        if name not in eligible:
            continue
        if home is None:
            home = name
        load = loads.get(name, 0.0)
        # An idle endpoint takes its keys whatever their size: alone, one prompt
        # larger than its share of the room would otherwise never go home.
        if load == 0.0 or load + cost <= capacity:
            return name, name == home
    least = min(eligible, key=lambda name: (loads.get(name, 0.0), name))
    return least, least == home


__all__ = ["PREFIX_KEY_BYTES", "PromptFacts", "Ring", "choose_bounded", "prompt_facts",
           "stable_hash", "utf8_len"]
