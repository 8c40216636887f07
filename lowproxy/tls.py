"""Upstream TLS trust: one ssl context, rebuilt only when the CA file changes.

With a CA file the proxy trusts exactly that bundle, TLS 1.2 or newer, with
hostname verification on. Kubernetes rotates a mounted Secret by swapping a
symlink, which changes the resolved file's identity (inode, mtime, size): the
context is rebuilt on the first connection after that, and connections pooled
under the old trust are retired (see ``generation``). A bundle that breaks
after start fails closed: TrustUnavailable, never the system store.
"""

from __future__ import annotations

import os
import ssl
from typing import NoReturn


class TrustUnavailable(Exception):
    """The configured CA bundle cannot be read or used."""


def _new_context(cafile: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # HTTP/1.1 only: the upstream side speaks h11.
    context.set_alpn_protocols(["http/1.1"])
    return context


class TrustStore:
    """Hands out the current client ssl context for https:// backends."""

    def __init__(self, ca_file: str) -> None:
        self.ca_file = ca_file
        self.generation = 0
        self._identity: tuple[int, int, int] | None = None
        self._context: ssl.SSLContext | None = None
        if not ca_file:
            self._context = _new_context(None)

    def context(self) -> ssl.SSLContext:
        """The context to open a TLS connection with; raises TrustUnavailable.

        Costs one stat() per new connection when a CA file is set; pooled
        connections do not call it.
        """
        if not self.ca_file:
            assert self._context is not None
            return self._context
        try:
            info = os.stat(self.ca_file)
        except OSError as exc:
            self._fail(f"CA file {self.ca_file}: {exc.strerror or exc}")
        identity = (info.st_ino, info.st_mtime_ns, info.st_size)
        if identity != self._identity or self._context is None:
            try:
                context = _new_context(self.ca_file)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                self._fail(f"CA file {self.ca_file}: {exc}")
            self._identity = identity
            self._context = context
            self.generation += 1
        return self._context

    def _fail(self, reason: str) -> NoReturn:
        """Forget the old trust and retire what was pooled under it: fail closed.

        A removed bundle must not leave pooled connections usable, any more than
        a corrupted one does: both start a new generation.
        """
        if self._context is not None or self._identity is not None:
            self._context = None
            self._identity = None
            self.generation += 1
        raise TrustUnavailable(reason) from None

    def current_generation(self) -> int:
        """The trust generation after re-checking the file (stat only)."""
        try:
            self.context()
        except TrustUnavailable:
            pass
        return self.generation


# -- the client side: HTTPS on the main port


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_ino, info.st_mtime_ns, info.st_size)


def _no_pass_phrase() -> bytes:
    raise ValueError("the key file is encrypted: lowproxy takes an unencrypted key")


class ServerCertificate:
    """The main port's certificate (and client CA for mTLS), re-read when a file changes.

    ``context()`` builds a fresh server context from the files, or raises
    TrustUnavailable naming the file; ``changed()`` says whether any file's
    identity (inode, mtime, size: a projected Secret's symlink swap changes it)
    differs from the one the last good context was built from. A context that
    fails to build leaves the previous one in use: a half-written rotation
    (new certificate, old key) must not take the listener down.
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "") -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._built_from: tuple[tuple[int, int, int] | None, ...] | None = None
        self._failed_on: tuple[tuple[int, int, int] | None, ...] | None = None

    def _identities(self) -> tuple[tuple[int, int, int] | None, ...]:
        files = (self.cert_file, self.key_file, self.client_ca_file)
        return tuple(_identity(path) if path else None for path in files)

    def changed(self) -> bool:
        """A file changed since the last context built, or since the last failure."""
        identities = self._identities()
        return identities != self._built_from and identities != self._failed_on

    def context(self) -> ssl.SSLContext:
        identities = self._failed_on = self._identities()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # The client side speaks h11: HTTP/1.1 only (RFC 7301 ALPN).
        context.set_alpn_protocols(["http/1.1"])
        try:
            # A password callback, so that an encrypted key is refused here
            # instead of OpenSSL asking for its pass phrase on the terminal (which
            # would block the event loop at a renewal).
            context.load_cert_chain(self.cert_file, self.key_file, password=_no_pass_phrase)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise TrustUnavailable(f"certificate {self.cert_file} / key {self.key_file}: "
                                   f"{_reason(exc)}") from None
        if self.client_ca_file:
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ValueError) as exc:
                raise TrustUnavailable(f"client CA file {self.client_ca_file}: "
                                       f"{_reason(exc)}") from None
            context.verify_mode = ssl.CERT_REQUIRED
        self._built_from, self._failed_on = identities, None
        return context


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
