"""Configuration: every setting, from flags and environment, checked at start.

``table`` declares the settings, ``settings`` builds the ``Config``, ``flags`` makes
their command-line flags, ``values`` parses one value (ports, durations,
endpoint URLs, allow lists). A mistake stops the
daemon at start with one line naming the setting.
"""

from .settings import (
    SETTINGS,
    Config,
    ConfigError,
    EndpointSpec,
    load_config,
    parse_endpoint,
    split_host_port,
)

__all__ = ["SETTINGS", "Config", "ConfigError", "EndpointSpec", "load_config",
           "parse_endpoint", "split_host_port"]
