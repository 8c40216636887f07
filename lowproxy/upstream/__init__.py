"""Upstream: the side towards backends.

``pool`` keeps httpcore's connections per endpoint and runs lowproxy's own h11
cycle on them; ``stream`` is the asyncio network stream and the few httpcore
internals it relies on; ``chunked`` decodes a chunked body while relaying it;
``errors`` is the family of upstream failures.
"""

from .endpoint import Endpoint
from .errors import UpstreamError, UpstreamTimeout
from .pool import Resolver, Upstream, UpstreamResponse, system_resolver

__all__ = ["Endpoint", "Resolver", "Upstream", "UpstreamError", "UpstreamResponse",
           "UpstreamTimeout", "system_resolver"]
