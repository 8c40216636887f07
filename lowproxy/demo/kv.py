"""The demo backend's stand-ins for tokens, the prefix cache and the KV transfer.

Tokens: the demo's tokenizer makes one token per whitespace-separated word of
the rendered prompt (``render_messages``); a word's id is a stable hash of it
(crc32, so every process and replica agrees), kept clear of the ids the demo
generates and of ``EOS_TOKEN_ID``. A completions prompt given as token ids is
taken as is.

Prefix cache: vLLM caches whole KV blocks, each keyed by a hash chained over
every token before it, and always recomputes at least the prompt's last token.
``PrefixCache`` does the same on the demo's tokens: bounded (LRU over blocks,
a prompt's tail blocks evicted before its head, as vLLM frees them), per backend.

KV transfer: ``KvRegistry`` records which transfers a prefill computed; a
prefill and a decode started in one process share one. Started as separate
processes, the decode asks the prefill's bootstrap server instead
(``GET /kv?key=...``, see backend.py): the emulated transfer.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from array import array
from collections import OrderedDict
from typing import Any
from urllib.parse import quote

EOS_TOKEN_ID = 2
# Generated token i has id OUTPUT_TOKEN_BASE + i and text "tok<i> ".
OUTPUT_TOKEN_BASE = 1000
WORD_ID_BASE = 10000
WORD_ID_SPAN = 1 << 20


def word_id(word: str) -> int:
    return WORD_ID_BASE + zlib.crc32(word.encode("utf-8", "surrogatepass")) % WORD_ID_SPAN


def _content_text(content: Any) -> str:
    """Text of a message's content: a string or a list of parts (OpenAI, Anthropic)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) if isinstance(part, dict) else str(part)
                        for part in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def render_messages(messages: Any, system: Any = None) -> str:
    """A chat template of the demo's own: '<role> <content>' per message, in order."""
    parts = [f"system {_content_text(system)}"] if system else []
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict):
            parts.append(f"{message.get('role', 'user')} {_content_text(message.get('content'))}")
    return "\n".join(parts)


def tokenize(text: str) -> list[int]:
    return [word_id(word) for word in text.split()]


def prompt_ids(prompt: Any) -> list[int]:
    """One completions prompt (a string or a list of token ids) as token ids."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return tokenize(prompt if isinstance(prompt, str) else json.dumps(prompt))


class PrefixCache:
    """vLLM's automatic prefix caching on the demo's tokens, bounded by ``blocks``."""

    def __init__(self, block_size: int = 16, blocks: int = 4096) -> None:
        self.block_size = max(1, block_size)
        self.capacity = blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _chain(self, tokens: list[int]) -> list[int]:
        # crc32 continued over the token ids' bytes: each block's value covers
        # every token before it (a chain), computed in C; the index keeps
        # equal crcs at different depths apart.
        hashes, previous = [], 0
        size = self.block_size
        try:
            raw = array("q", tokens).tobytes()
        except OverflowError:  # ids beyond 64 bits: vLLM would refuse them anyway
            raw = array("q", [token % (1 << 63) for token in tokens]).tobytes()
        step = size * 8
        for index, start in enumerate(range(0, len(tokens) - size + 1, size)):
            previous = zlib.crc32(raw[start * 8:start * 8 + step], previous)
            hashes.append(previous | (index << 32))
        return hashes

    def lookup(self, tokens: list[int]) -> int:
        """How many leading tokens are cached: whole blocks, never the last token."""
        held = []
        for digest in self._chain(tokens[:-1] if tokens else tokens):
            if digest not in self._blocks:
                break
            held.append(digest)
        for digest in reversed(held):  # the first block freshest: see insert
            self._blocks.move_to_end(digest)
        return len(held) * self.block_size

    def insert(self, tokens: list[int]) -> None:
        """The prompt's KV is computed (or pulled): its full blocks are now cached."""
        if self.capacity <= 0:
            return
        # Last block first, so that a prompt's tail ages out before its head, as
        # vLLM frees a request's blocks in reverse: evicting a first block would
        # make every block after it useless.
        for digest in reversed(self._chain(tokens)):
            self._blocks[digest] = None
            self._blocks.move_to_end(digest)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)


class KvRegistry:
    """Which transfers a prefill has computed, standing in for the KV transfer."""

    def __init__(self) -> None:
        self._ready: dict[str, asyncio.Future[str]] = {}

    def _future(self, key: str) -> asyncio.Future[str]:
        future = self._ready.get(key)
        if future is None:
            future = self._ready[key] = asyncio.get_running_loop().create_future()
        return future

    def computed(self, key: str, engine_id: str) -> None:
        future = self._future(key)
        if not future.done():
            future.set_result(engine_id)

    def is_computed(self, key: str) -> bool:
        future = self._ready.get(key)
        return future is not None and future.done()

    def engine_of(self, key: str) -> str | None:
        future = self._ready.get(key)
        return future.result() if future is not None and future.done() else None

    def take(self, key: str) -> bool:
        """Whether the KV of ``key`` was computed; a decode pulls it once, so forget it
        (a long benchmark or --demo run would otherwise keep every key)."""
        future = self._ready.get(key)
        if future is None or not future.done():
            return False
        del self._ready[key]
        return True

    async def wait(self, key: str, timeout: float | None) -> str:
        future = self._future(key)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            if future.done():
                self._ready.pop(key, None)


async def remote_kv(address: str, key: str, take: bool, timeout: float = 5.0) -> str | None:
    """Ask a prefill's bootstrap server (``http://host:port``) whether ``key`` was
    computed: its engine id, or None. Plain HTTP/1.0 over loopback: the demo only."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    target = f"/kv?key={quote(key)}&take={int(take)}"
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port)), timeout)
    except (OSError, ValueError, asyncio.TimeoutError):
        return None
    try:
        writer.write(f"GET {target} HTTP/1.0\r\nhost: {hostport}\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.0 200"):
        return None
    try:
        return str(json.loads(body)["engine_id"])
    except (ValueError, KeyError, TypeError):
        return None
