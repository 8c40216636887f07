"""The proxy: what the daemon runs for each client request.

``handler`` (the ``Proxy``) routes a request to the probes, metrics, admin or a
generation; for a generation it asks ``routing`` which backends, ``handshakes`` for
the plan, and hands the plan to ``dispatch``, which runs the legs over ``upstream``
(``auxiliary_legs`` for the prefill leg and aborts) and relays decode's bytes to the
client's ``ResponseWriter``. ``failures`` names each failure kind once and
``failure_answers`` answers it; ``tracing`` makes the optional spans, ``exchange``
is one request's record.
"""

from .handler import Proxy

__all__ = ["Proxy"]
