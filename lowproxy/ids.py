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
    __slots__ = ("_prefix", "_count")

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count(1)

    def next_hex(self) -> str:
        """32 hex digits, never the same twice in this process."""
        return f"{self._prefix}{next(self._count):016x}"
