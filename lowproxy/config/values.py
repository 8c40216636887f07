"""How each setting's text becomes a value: the parsers behind config.SETTINGS.

Each parser takes the raw text and returns the value or raises ValueError with
a reason; config.load_config names the setting. ``split_host_port`` is the one
host:port parser: backend URLs, allow-list entries and scheduler-named
prefill targets all go through it, so they agree on what a port is.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EndpointSpec:
    """One configured backend, as the operator wrote it.

    ``discover`` marks ``dns+http(s)://name:port``: the name is resolved to all
    of its addresses (a headless Kubernetes Service) and re-resolved while
    running. ``bootstrap_port`` overrides the handshake's bootstrap port for
    this endpoint only (written ``http://host:port#bootstrap_port=9000``).
    """

    scheme: str
    host: str
    port: int
    base_path: str = ""
    discover: bool = False
    bootstrap_port: int | None = None

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def label(self) -> str:
        prefix = "dns+" if self.discover else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{prefix}{self.scheme}://{host}:{self.port}{self.base_path}"


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _shown(text: str) -> str:
    """A backend URL as an error quotes it: userinfo (a password) masked."""
    return repr(_USERINFO.sub(r"\1***@", text.strip()))


_USERINFO = re.compile(r"^((?:dns\+)?[A-Za-z][A-Za-z0-9+.-]*://)?[^/@]*@")


def parse_endpoint(text: str) -> EndpointSpec:
    """Parse one backend URL; raise ValueError with a reason when it is unusable."""
    raw = text.strip()
    bootstrap_port = None
    if "#" in raw:
        raw, _, fragment = raw.partition("#")
        key, _, value = fragment.partition("=")
        if key.strip() != "bootstrap_port":
            raise ValueError(f"unknown option {fragment!r} (only #bootstrap_port=N)")
        bootstrap_port = parse_port(value)
    raw = raw.rstrip("/")
    discover = raw.startswith("dns+")
    if discover:
        raw = raw[4:]
    scheme, sep, rest = raw.partition("://")
    scheme = scheme.lower()  # RFC 3986 3.1: HTTP:// is http://, as httpx took it
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"{_shown(text)} is not an http:// or https:// URL")
    authority, _, path = rest.partition("/")
    if "@" in authority:
        raise ValueError("credentials in a backend URL are not supported")
    if "?" in authority or "?" in path:
        raise ValueError("a backend URL takes no query string")
    if path:
        # The client's own target (/v1/chat/completions) is sent as it came: a
        # base path would double it (http://h:8000/v1 -> /v1/v1/...).
        raise ValueError(f"{_shown(text)}: a backend URL takes no path (write "
                         "scheme://host:port; the client's path is sent as it came)")
    if authority.startswith("["):
        host, _, port_text = authority[1:].partition("]")
        port_text = port_text[1:] if port_text.startswith(":") else port_text
    else:
        host, _, port_text = authority.partition(":")
    if not host:
        raise ValueError(f"{_shown(text)} has no host")
    if not _is_address(host):
        try:  # what getaddrinfo will do with it: a label empty or over 63 fails there
            host.encode("idna")
        except UnicodeError:
            raise ValueError(f"{_shown(text)}: {host!r} is not a valid host name (an "
                             "empty label, or one over 63 characters)") from None
    port = parse_port(port_text) if port_text else (443 if scheme == "https" else 80)
    return EndpointSpec(scheme, host.lower(), port, "", discover, bootstrap_port)


def parse_port(text: str) -> int:
    """A TCP port: ASCII digits only (int() would also take "+80", "8_0", "٨٠")."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{text!r} is not a port number")
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"port {value} out of range 1-65535")
    return value


# -- value parsers: each takes the raw text and returns the value or raises ValueError


def int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise ValueError(f"{value} is outside {low}..{high}")
        return value

    parse.metavar = "N"  # type: ignore[attr-defined]  # shown in --help (config_flags)
    return parse


def seconds_value(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{text!r} must be a finite number >= 0")
    return value


def any_float(text: str) -> float:
    """A number as Python's float() reads it, inf, nan and negatives included: the GCO
    proxy's parse of a setting it never uses, so every value it started with starts."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def optional_seconds(text: str) -> float | None:
    """Seconds, where empty or 0 means no bound."""
    if not text.strip():
        return None
    value = seconds_value(text)
    return value or None


def bool_value(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean (1/0, true/false)")


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    parse.metavar = "{" + ",".join(choices) + "}"  # type: ignore[attr-defined]
    return parse


def text_value(text: str) -> str:
    return text


def stripped(text: str) -> str:
    return text.strip()


def endpoints(text: str) -> tuple[EndpointSpec, ...]:
    return tuple(parse_endpoint(item) for item in text.split(",") if item.strip())


def peer_endpoints(text: str) -> tuple[EndpointSpec, ...]:
    """Other proxy replicas (PD_PROXY_PEERS): backend URL forms, without a bootstrap port."""
    specs = endpoints(text)
    for spec in specs:
        if spec.bootstrap_port is not None:
            raise ValueError(f"{spec.label}: a peer takes no #bootstrap_port")
    return specs


peer_endpoints.metavar = "URL"  # type: ignore[attr-defined]


def allow_list(text: str) -> tuple[str, ...]:
    """Hosts, host:port pairs and CIDRs; validated here, matched in routing.allow."""
    entries = tuple(item.strip().lower() for item in text.split(",") if item.strip())
    for entry in entries:
        if "/" in entry:
            ipaddress.ip_network(entry, strict=False)
        else:  # a bad host:port must stop the start, not the first request
            split_host_port(entry)
    return entries


allow_list.metavar = "TARGETS"  # type: ignore[attr-defined]


def words(text: str) -> tuple[str, ...]:
    """Options as a shell would split them (quotes kept together)."""
    return tuple(shlex.split(text))


words.metavar = "OPTIONS"  # type: ignore[attr-defined]


def status_value(text: str) -> int:
    return int_in(100, 599)(text)


def split_host_port(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]:port`` -> (lowercased host, port or None)."""
    text = text.strip().lower()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        return host, None
    return host, parse_port(port_text)
