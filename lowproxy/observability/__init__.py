"""Observability: what an operator sees of a running proxy.

``metrics`` holds the counters and histograms and renders /metrics, ``share``
merges them across worker processes, ``logs`` writes the access and error lines
(plain or JSON). Nothing here imports the rest of lowproxy.
"""

from . import logs
from .metrics import Counter, Metrics
from .share import MetricsShare, mark_dead

__all__ = ["Counter", "Metrics", "MetricsShare", "logs", "mark_dead"]
