"""Upstream: the side towards backends.

``pool`` keeps httpcore's connections per endpoint (reuse, retirement,
retries); ``cycle`` is lowproxy's own request/response cycle on a connection's
h11 state, parsed in the stream's callbacks; ``httpcore_internals`` names every
httpcore internal the cycle relies on (pinned by
tests/upstream/test_httpcore_fence.py); ``stream`` is the asyncio network
stream; ``chunked`` decodes a chunked body while relaying it; ``errors`` is the
family of upstream failures.
"""

from .endpoint import Endpoint
from .errors import UpstreamError, UpstreamTimeout
from .pool import Resolver, Upstream, UpstreamResponse, system_resolver

__all__ = ["Endpoint", "Resolver", "Upstream", "UpstreamError", "UpstreamResponse",
           "UpstreamTimeout", "system_resolver"]
