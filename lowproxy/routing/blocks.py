"""A request's prompt as chained hashes of fixed-size blocks, for cache-aware routing.

vLLM and SGLang cache a prompt's KV in blocks, each keyed by everything before
it; a router that remembers, at block granularity, what it sent where can tell
which endpoint's cache holds the longest part of a new prompt (cache_aware.py).
The router has no tokenizer, so blocks are of bytes of the rendered prompt:

- chat, Messages, Responses: each message as ``role NUL text SOH``, in order
  (the system prompt first), so a conversation's next turn starts with the
  bytes of the turn before it;
- completions: the prompt's text; token-id prompts and generate: 4 bytes per id.

Block i's key covers every block before it: the xor of the hashes of each
block paired with a constant of its depth, accumulated (``itertools.accumulate``),
so the whole chain is computed by C loops over bytes already in hand (issue
22 budgets 15 µs for routing an 8 KB prompt; a Python loop per block costs
more). The block hash is Python's own ``hash()`` of bytes when the keys live
in this process's index only: siphash, salted per process. With
PD_PROXY_PEERS, replicas exchange keys (peers.py), so they must be the same
in every process: ``stable_chain_of`` hashes each block by crc32 and mixes it
with its depth through CPython's hash of a tuple of ints (unsalted: only str
and bytes hashes are; the same on every 64-bit CPython since 3.8, and a batch
carries ``hash_probe`` so a replica of another build refuses it). That costs
about 2 µs more per 8 KB prompt (crc32 is slower than siphash here: zlib
1.2.13 has no hardware crc), hence only with peers. A block is then known by
its 32-bit crc (all edits within 32 bits are seen; two different blocks at
one depth collide once in 2^32, a misroute that costs one cache miss); the
chain's keys are 64-bit. What replicas must agree on without peers, the first
block's hash for cold placement, is crc32 too. A prompt is estimated at
TOKEN_BYTES bytes per token.
"""

from __future__ import annotations

import random
import re
import zlib
from array import array
from functools import lru_cache
from itertools import accumulate
from operator import xor
from typing import Any, Mapping, NamedTuple

from .prompts import Conversation, message_text, prompt_of

TOKEN_BYTES = 4  # bytes of text per token, the estimate every figure here uses
# One constant per depth: the same blocks at another depth make other keys.
_DEPTHS = (lambda rng: tuple(rng.getrandbits(62) for _ in range(1 << 14)))(random.Random(22))
_LEADING = ("system", "developer")


class PromptBlocks(NamedTuple):
    chain: list[int]  # one hash per whole block, in order
    tokens: int       # estimated prompt tokens
    first: int        # crc32 of the first block (of the prompt, if shorter): cold placement
    data: bytes = b""  # the rendered prompt
    surface: str = ""  # and where it came from, for ``opening``
    body: Any = None
    block_bytes: int = 0

    def without_prompt(self) -> PromptBlocks:
        """The hashes and counts alone: what is remembered once a choice is made (the
        prompt and the client's body must not live as long as a stream does)."""
        return self._replace(data=b"", body=None) if self.data or self.body is not None else self

    def opening(self) -> int:
        """adler32 of the block that ends the conversation's first turn: it tells
        conversations of one group apart, the same in every process (a hot
        group's conversations are spread over its endpoints by it). Computed
        only for such a group."""
        data, end = self.data, len(self.data)
        turns = _first_turn(self.surface, self.body) if self.body is not None else 0
        if turns:
            end = 0
            for _ in range(turns):
                found = data.find(b"\1", end)
                if found < 0:
                    end = len(data)
                    break
                end = found + 1
        return zlib.adler32(memoryview(data)[max(0, end - self.block_bytes):end])


NO_BLOCKS = PromptBlocks([], 0, 0)


def _conversation(system: Any, messages: Any) -> bytes:
    # Pieces joined once (no per-message string holding a copy of its text).
    parts = ["system", "\0", message_text(system), "\1"] if system is not None else []
    if isinstance(messages, list):
        add = parts.extend
        for message in messages:
            if isinstance(message, dict):
                role = message.get("role")
                add((role if isinstance(role, str) else "", "\0",
                     message_text(message.get("content")), "\1"))
    return "".join(parts).encode("utf-8", "surrogatepass")


def _ids(ids: list[Any]) -> bytes | None:
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
        return None
    try:
        return array("I", ids).tobytes()
    except OverflowError:
        return array("I", [token % (1 << 32) for token in ids]).tobytes()


def rendered(surface: str, body: Mapping[str, Any]) -> bytes | None:
    """The prompt bytes blocks are cut from; None for a shape with no prompt."""
    prompt = prompt_of(surface, body)
    if isinstance(prompt, Conversation):
        return _conversation(prompt.system, prompt.messages)
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, list):
        return _ids(prompt)
    return None


@lru_cache(maxsize=8)
def _splitter(block_bytes: int) -> re.Pattern[bytes]:
    return re.compile(b".{%d}" % block_bytes, re.S)


def chain_of(data: bytes, block_bytes: int) -> list[int]:
    """The chained key of every whole block of ``data`` (the first 16384 blocks)."""
    blocks = _splitter(block_bytes).findall(data)
    # hash((block, depth)): mixed non-linearly, so equal blocks never cancel out.
    return list(accumulate(map(hash, zip(blocks, _DEPTHS, strict=False)), xor))


def stable_chain_of(data: bytes, block_bytes: int) -> list[int]:
    """``chain_of`` with keys that are the same in every process (see the module's
    docstring): crc32 of each block, mixed with its depth's constant."""
    blocks = _splitter(block_bytes).findall(data)
    return list(accumulate(map(hash, zip(map(zlib.crc32, blocks), _DEPTHS, strict=False)),
                           xor))


def hash_probe(block_bytes: int) -> int:
    """A stable chain's last key over a fixed text: equal in two processes only when
    their stable keys are (peers compare it before they trust each other's keys)."""
    return stable_chain_of(b"lowproxy" * (2 * block_bytes // 8 + 1), block_bytes)[-1]


def _first_turn(surface: str, body: Mapping[str, Any]) -> int:
    """How many rendered messages (each ends with SOH) a conversation's first turn
    takes: the leading system messages and the first other one; 0 (the whole
    prompt) for completions and token ids, each its own conversation."""
    if surface not in ("chat", "messages", "responses"):
        return 0
    messages = body.get("input" if surface == "responses" else "messages")
    turns = 1 + (surface == "messages" and body.get("system") is not None) \
        + (surface == "responses" and body.get("instructions") is not None)
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in _LEADING:
                break
            turns += 1
    return turns


def prompt_blocks(surface: str, body: Mapping[str, Any], block_bytes: int,
                  stable: bool = False) -> PromptBlocks:
    """``stable``: keys the same in every process (PD_PROXY_PEERS), else this one's."""
    data = rendered(surface, body)
    if data is None:
        return NO_BLOCKS
    chain = stable_chain_of(data, block_bytes) if stable else chain_of(data, block_bytes)
    first = zlib.crc32(data[:block_bytes])
    return PromptBlocks(chain, len(data) // TOKEN_BYTES + 1, first, data, surface, body,
                        block_bytes)


__all__ = ["NO_BLOCKS", "TOKEN_BYTES", "PromptBlocks", "chain_of", "hash_probe", "prompt_blocks",
           "rendered", "stable_chain_of"]
