"""API keys: the backend key lowproxy sends, the client keys it accepts.

A key comes from a literal setting or from a file. A file is re-read when its
identity (inode, device, mtime, size) changes, as tls.TrustStore does for the
CA file: Kubernetes rotates a mounted Secret by swapping a symlink, so a new
key is used on the next request, without a restart. A file that becomes
unreadable keeps the last keys read (a rotation half done must not turn into
an outage) and says so once in the log, naming the file, never its content.

No key is ever put in a log line, a metric or an error body: nothing here
formats one, and ``__repr__`` hides them.
"""

from __future__ import annotations

import hmac
import logging
import os
import re

log = logging.getLogger("lowproxy.keys")

Identity = tuple[int, int, int, int]


def read_keys(path: str, many: bool, allow_empty: bool = False) -> tuple[bytes, ...]:
    """The keys a file holds (one, or one per line); raise ValueError when unusable."""
    try:
        with open(path, "rb") as file:
            text = file.read()
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    lines = [line.strip() for line in text.splitlines()]
    keys = tuple(line for line in lines if line)
    if not keys and not allow_empty:
        raise ValueError(f"{path} holds no key")
    if not many and len(keys) > 1:
        raise ValueError(f"{path} holds more than one line; one key expected")
    if not many and keys and not header_safe(b"Bearer " + keys[0]):
        raise ValueError(f"{path}: the key holds a character a header value cannot carry")
    return keys


# A header field value (RFC 9110 section 5.5), as h11's parser accepts one: the
# backend key is sent in heads built without h11's own check (lowproxy/h11_internals/).
_FIELD_VALUE = re.compile(rb"[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?")


def header_safe(value: bytes) -> bool:
    """Whether ``value`` can be sent as a header value as it is."""
    return _FIELD_VALUE.fullmatch(value) is not None


class KeySource:
    """The current keys of one setting: literal ones, or a file's (re-read on change)."""

    __slots__ = ("path", "many", "_keys", "_identity", "_failing")

    def __init__(self, literal: tuple[str, ...] = (), path: str = "",
                 many: bool = False) -> None:
        self.path = path
        self.many = many
        self._keys: tuple[bytes, ...] = tuple(key.encode() for key in literal if key)
        self._identity: Identity | None = None
        self._failing = False
        if path:
            self._refresh()

    @property
    def configured(self) -> bool:
        return bool(self.path or self._keys)

    def keys(self) -> tuple[bytes, ...]:
        """The keys now: one stat() per call when they come from a file."""
        if self.path:
            self._refresh()
        return self._keys

    def _refresh(self) -> None:
        try:
            info = os.stat(self.path)
        except OSError as exc:
            self._fail(exc.strerror or str(exc))
            return
        identity = (info.st_ino, info.st_dev, info.st_mtime_ns, info.st_size)
        if identity == self._identity:
            return
        try:
            # A client key file emptied on purpose refuses everyone; an empty
            # backend key file is a rotation gone wrong: the last key stays.
            keys = read_keys(self.path, self.many, allow_empty=self.many)
        except ValueError as exc:
            self._fail(str(exc))
            return
        if self._identity is not None:
            log.info("key file %s changed: re-read", self.path)
        self._keys = keys
        self._identity = identity
        self._failing = False

    def _fail(self, reason: str) -> None:
        # Re-stat next time (the identity is forgotten); warn once per failure run.
        self._identity = None
        if not self._failing:
            self._failing = True
            log.warning("key file %s unusable, keeping the keys read before: %s",
                        self.path, reason)

    def __repr__(self) -> str:
        return f"<KeySource {'file ' + self.path if self.path else 'literal'} keys=***>"


class BackendKey:
    """The ``authorization`` header lowproxy sends to backends, if any."""

    __slots__ = ("source",)

    def __init__(self, key: str = "", path: str = "") -> None:
        self.source = KeySource((key,) if key else (), path, many=False)

    def header(self) -> tuple[bytes, bytes] | None:
        keys = self.source.keys()
        return (b"authorization", b"Bearer " + keys[0]) if keys else None

    def headers(self) -> list[tuple[bytes, bytes]]:
        header = self.header()
        return [header] if header is not None else []


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of ``Bearer <token>``; the scheme is case-insensitive (RFC 9110 11.1)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


def matches_any(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Whether ``token`` is one of ``keys``, in time independent of where they differ.

    Every key is compared (no early exit), so the time taken says neither which
    key matched nor how much of one did.
    """
    if token is None:
        return False
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


class ClientKeys:
    """The keys clients must present as ``authorization: Bearer <key>``.

    On the Anthropic surface ``x-api-key: <key>`` (what the Anthropic SDKs send)
    is taken too; the proxy never forwards it (headers.py's allow list).
    """

    __slots__ = ("source",)

    def __init__(self, keys: tuple[str, ...] = (), path: str = "") -> None:
        self.source = KeySource(keys, path, many=True)

    @property
    def required(self) -> bool:
        return self.source.configured

    def allows(self, authorization: bytes | None, api_key: bytes | None = None) -> bool:
        keys = self.source.keys()
        if matches_any(bearer_token(authorization), keys):
            return True
        return api_key is not None and matches_any(api_key.strip() or None, keys)


__all__ = ["BackendKey", "ClientKeys", "KeySource", "bearer_token", "matches_any", "read_keys"]
