"""Which handler serves a request: pure functions of method and path, and the route table.

Generation surfaces are matched by path suffix, longest first, so a gateway
prefix (``/inference/ep/v1/chat/completions``) keeps working.
"""

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

# The generation surfaces: split into a prefill and a decode leg (vLLM 0.33
# honours top-level kv_transfer_params on each).
CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"
MESSAGES = "messages"
GENERATE = "generate"
# SGLang's native POST /generate (text or input_ids, sampling_params): a
# generation surface only under PD_PROXY_KV_PROTOCOL=sglang, where a decode
# refuses it without a bootstrap room; elsewhere it is passed through.
SGLANG_GENERATE = "sglang-generate"
SGLANG_GENERATE_SUFFIX = "/generate"

GENERATION_ROUTES: tuple[tuple[str, str], ...] = (
    ("/chat/completions", CHAT),          # OpenAI chat
    ("/completions", COMPLETIONS),        # OpenAI completions
    ("/responses", RESPONSES),            # OpenAI Responses API
    ("/messages", MESSAGES),              # Anthropic Messages API
    ("/inference/v1/generate", GENERATE),  # vLLM token in, token out (--enable-scale-out)
)
# Generate nothing, so priming prefill for them would only waste a GPU: they go
# to decode alone, like every other path (the GCO proxy primed /embeddings too).
DECODE_ONLY_SUFFIXES = ("/embeddings", "/pooling", "/classify", "/score", "/rerank",
                        "/tokenize", "/detokenize")


# The Anthropic Messages surface (vLLM serves both): its clients send x-api-key
# and read Anthropic's error shape.
ANTHROPIC_SUFFIXES = ("/messages", "/messages/count_tokens")


def speaks_anthropic(path: str) -> bool:
    """Whether a request to ``path`` is on the Anthropic surface (its keys, its errors)."""
    return path.endswith(ANTHROPIC_SUFFIXES)


def surface_of(path: str, sglang: bool = False) -> str | None:
    """The generation surface a POST to ``path`` is, or None (``sglang``: the
    configured handshake is SGLang's, whose native /generate is one too)."""
    for suffix, surface in GENERATION_ROUTES:
        if path.endswith(suffix):
            return surface
    if sglang and path.endswith(SGLANG_GENERATE_SUFFIX):
        return SGLANG_GENERATE
    return None


def admin_action(path: str) -> str | None:
    """add, remove or list for an admin path; None for any other path."""
    for action, suffix in ADMIN_ACTIONS:
        if path.endswith(suffix):
            return action
    return None


def route_and_surface(method: bytes, path: str, sglang: bool = False
                      ) -> tuple[str, str | None]:
    """The route of a request, and its generation surface (None unless GENERATION);
    ``sglang``: the configured handshake is SGLang's (see surface_of)."""
    if admin_action(path) is not None:
        return ADMIN, None  # whatever the method: the admin path is never forwarded
    if method in (b"GET", b"HEAD"):
        if path in HEALTH_PATHS:
            return HEALTH, None
        if path == "/readyz":
            return READY, None
        if path == "/metrics":
            return METRICS, None
        return PASSTHROUGH, None
    surface = surface_of(path, sglang) if method == b"POST" else None
    return (PASSTHROUGH if surface is None else GENERATION), surface


def classify(method: bytes, path: str, sglang: bool = False) -> str:
    return route_and_surface(method, path, sglang)[0]
