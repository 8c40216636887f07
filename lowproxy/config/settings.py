"""One frozen Config, built once at start from PD_PROXY_* variables and flags.

Every setting is declared once in SETTINGS (table.py): its environment variable, its flag,
its parser, its default and its meaning. The README's configuration reference
is written from the same table (``python -m lowproxy --help`` prints it too).
A value that does not parse stops the daemon before it binds anything, with one
line naming the variable or flag, and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..keys import read_keys
from .flags import Setting, UsageError, flag_text
from .flags import build_parser as _build_parser
from .table import SETTINGS
from .values import (
    EndpointSpec,
    parse_endpoint,
    parse_port,
    split_host_port,
)

__all__ = ["SETTINGS", "Config", "ConfigError", "EndpointSpec", "Setting", "build_parser",
           "load_config", "parse_endpoint", "parse_port", "setting_name", "split_host_port"]


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the setting.

    ``setting`` is the variable or flag named, when one is; ``usage`` marks a
    command line argparse could not read (the daemon adds a short usage line).
    """

    def __init__(self, message: str, setting: str = "", usage: bool = False) -> None:
        super().__init__(message)
        self.setting = setting
        self.usage = usage


@dataclass(frozen=True)
class Config:
    host: str = "0.0.0.0"
    port: int = 8000
    prefill: tuple[EndpointSpec, ...] = ()
    decode: tuple[EndpointSpec, ...] = ()
    ca_file: str = ""
    residency_timeout: float = 2.0
    no_decode_status: int = 503
    no_decode_message: str = "no available decode backend"
    admin_api_key: str = ""
    backend_api_key: str = ""  # keys: hidden by __repr__
    backend_api_key_file: str = ""
    forward_authorization: bool = False
    client_api_keys: tuple[str, ...] = ()
    client_api_keys_file: str = ""
    log_level: str = "info"
    log_format: str = "text"
    prefill_timeout: float = 300.0
    connect_timeout: float = 5.0
    decode_timeout: float | None = None
    decode_first_byte_timeout: float | None = None
    kv_protocol: str = "relay"
    on_prefill_failure: str = "recompute"
    rewrite_cached_tokens: bool = True
    forward_prompt_token_ids: bool = False
    mooncake_bootstrap_port: int = 8998
    sglang_bootstrap_port: int = 8998
    sglang_admin_api_key: str = ""  # a key: hidden by __repr__
    dns_refresh: float = 10.0
    prefill_header_allow: tuple[str, ...] = ()
    # -- routing: the same defaults as SETTINGS (health checks every 5 s, affinity)
    health_interval: float = 5.0
    health_timeout: float = 2.0
    health_failures: int = 2
    prefill_policy: str = "cache-aware"
    affinity_slack: float = 0.25
    prefix_block_bytes: int = 512
    prefix_cache_tokens: int = 262144
    cache_allowance_tokens: int = 4096
    decode_first_tokens: int = 0
    decode_allowance: int = 4
    min_prefill_prompt_bytes: int = 0
    peers: tuple[EndpointSpec, ...] = ()
    upstream_keepalive: bool = True
    upstream_max_requests: int = 1000
    upstream_max_age: float = 30.0
    upstream_idle: float = 4.0
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout: float = 30.0
    tls_handshake_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    client_write_timeout: float = 60.0
    max_connections: int = 10000
    drain_seconds: float = 25.0
    metrics_port: int = 0
    trace: bool = False
    otel: bool = False
    loop: str = "auto"
    workers: int = 1
    demo_args: tuple[str, ...] = ()
    # -- client-side TLS (issue 13)
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    demo: bool = False

    def __repr__(self) -> str:  # never print a key
        shown = dataclasses.replace(
            self, admin_api_key="***" if self.admin_api_key else "",
            backend_api_key="***" if self.backend_api_key else "",
            sglang_admin_api_key="***" if self.sglang_admin_api_key else "",
            client_api_keys=("***",) if self.client_api_keys else (),
            # the demo backends' --api-key may be among their options
            demo_args=("***",) if any("api-key" in arg for arg in self.demo_args)
            else self.demo_args)
        fields = ", ".join(f"{f.name}={getattr(shown, f.name)!r}" for f in dataclasses.fields(self))
        return f"Config({fields})"


def build_parser() -> argparse.ArgumentParser:
    return _build_parser(SETTINGS)


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                ) -> tuple[Config, argparse.Namespace]:
    """Build the Config from the environment and argv (flags win). Raise ConfigError."""
    environ = os.environ if environ is None else environ
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        raise ConfigError(str(exc), usage=True) from None
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        flagged = getattr(args, setting.field)
        if flagged is not None:
            source, text = setting.flag, flag_text(setting, flagged)
        elif setting.env in environ:
            source, text = setting.env, environ[setting.env]
        else:
            source, text = setting.env, setting.default
        try:
            values[setting.field] = setting.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}", source) from None
    values["demo"] = bool(args.demo)
    _check_keys(values, setting_name(args))
    return Config(**values), args


def setting_name(args: argparse.Namespace | None = None) -> Callable[[str], str]:
    """How a start error names a setting (by field): its flag when the flag was given
    on the command line (``args``), else its variable."""
    by_field = {setting.field: setting for setting in SETTINGS}

    def name(field: str) -> str:
        setting = by_field[field]
        return setting.flag if getattr(args, field, None) is not None else setting.env

    return name


def _check_keys(values: dict[str, Any], name: Callable[[str], str]) -> None:
    """Key settings that contradict each other, or a key file unusable at start."""
    pairs = (("backend_api_key", "backend_api_key_file"),
             ("client_api_keys", "client_api_keys_file"),
             ("backend_api_key", "forward_authorization"),
             ("backend_api_key_file", "forward_authorization"))
    named = {setting.field: setting for setting in SETTINGS}
    for first, second in pairs:
        if values[first] and values[second]:
            a, b = named[first], named[second]
            raise ConfigError(f"{a.env} ({a.flag}) and {b.env} ({b.flag}) cannot both be set",
                              a.env)
    for field, many in (("backend_api_key_file", False), ("client_api_keys_file", True)):
        if values[field]:
            try:
                read_keys(values[field], many)
            except ValueError as exc:
                raise ConfigError(f"{name(field)}: {exc}", name(field)) from None
