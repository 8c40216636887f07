"""Ids the proxy makes: request ids, Mooncake transfer ids, SGLang rids.

64 random bits drawn once per process (workers fork before the Proxy is
built, so each has its own) and a counter: unique within a process by
construction, across processes with probability 1 - n^2/2^65, and without
uuid4's getrandom syscall and object per id (2.7 against 0.4 us). Fixed
width (32 hex digits), so that no SGLang rid is a prefix of another (SGLang
aborts by rid prefix). They are correlation ids: nothing authorises by them.
"""

from __future__ import annotations

import itertools
import os


class Ids:
    __slots__ = ("_prefix", "_count", "_uuid_head")

    def __init__(self) -> None:
        self._prefix = prefix = os.urandom(8).hex()
        self._count = itertools.count(1)
        # next_uuid's first three groups: the prefix's alone, so written once.
        self._uuid_head = f"{prefix[:8]}-{prefix[8:12]}-4{prefix[13:16]}-"

    def next_hex(self) -> str:
        """32 hex digits, never the same twice in this process."""
        return f"{self._prefix}{next(self._count):016x}"

    def next_uuid(self) -> str:
        """A next_hex() in the shape of a random UUID (RFC 9562 version 4, variant 10).

        Where a peer expects a uuid4 (the llm-d sidecar's Mooncake transfer ids).
        The version digit takes 4 of the prefix's 64 random bits; the variant digit
        is the counter's highest, 0 for the first 2^60 ids, so ids stay distinct.
        """
        count = f"{next(self._count):016x}"  # next_hex()'s last 16 digits
        return f"{self._uuid_head}{'89ab'[int(count[0], 16) & 3]}{count[1:4]}-{count[4:]}"
