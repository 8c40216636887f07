"""Which handler serves a request: a pure function of method and path."""

from __future__ import annotations

HEALTH = "health"
READY = "ready"
METRICS = "metrics"
ADMIN = "admin"
GENERATION = "generation"
PASSTHROUGH = "passthrough"

# The admin paths (admin.py), matched by suffix as the GCO proxy matched
# .../instances/add: behind any prefix, whatever the method, never forwarded.
ADMIN_SUFFIX = "/instances/add"
ADMIN_ACTIONS = (("add", ADMIN_SUFFIX), ("remove", "/instances/remove"), ("list", "/instances"))
HEALTH_PATHS = frozenset({"/health", "/healthz"})
# /embeddings generates nothing: priming prefill for it would only waste a GPU,
# so it goes straight to decode (the GCO proxy primed prefill for it too).
GENERATION_SUFFIXES = ("/completions", "/chat/completions")


def admin_action(path: str) -> str | None:
    """add, remove or list for an admin path; None for any other path."""
    for action, suffix in ADMIN_ACTIONS:
        if path.endswith(suffix):
            return action
    return None


def classify(method: bytes, path: str) -> str:
    if admin_action(path) is not None:
        return ADMIN  # whatever the method: the admin path is never forwarded
    if method in (b"GET", b"HEAD"):
        if path in HEALTH_PATHS:
            return HEALTH
        if path == "/readyz":
            return READY
        if path == "/metrics":
            return METRICS
        return PASSTHROUGH
    if method == b"POST" and path.endswith(GENERATION_SUFFIXES):
        return GENERATION
    return PASSTHROUGH
