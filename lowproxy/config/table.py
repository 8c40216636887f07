"""Every setting lowproxy takes, declared once: variable, flag, parser, default, meaning.

``settings`` builds the ``Config`` from this table, ``flags`` turns it into the
command line, and the README's Configuration table is checked against it.
"""

from __future__ import annotations

from ..keys import header_safe
from .flags import Setting
from .values import (
    allow_list,
    any_float,
    bool_value,
    choice,
    endpoints,
    int_in,
    optional_seconds,
    peer_endpoints,
    seconds_value,
    status_value,
    stripped,
    text_value,
    words,
)

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _ratio(text: str) -> float:
    """A finite number >= 0 (the affinity slack)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"{text!r} must be a finite number >= 0")
    return value


def _positive_seconds(text: str) -> float:
    """Seconds > 0 (an asyncio handshake bound cannot be 0)."""
    value = seconds_value(text)
    if not value > 0:
        raise ValueError(f"{text!r} must be more than 0 seconds")
    return value


_ratio.metavar = "RATIO"  # type: ignore[attr-defined]
_positive_seconds.metavar = "SECONDS"  # type: ignore[attr-defined]


def _backend_key(text: str) -> str:
    """A key sent in a header value (to backends, to peers), trimmed as a mounted
    Secret's trailing newline asks: never echoed in an error."""
    key = text.strip()
    if key and not header_safe(b"Bearer " + key.encode()):
        raise ValueError("the key holds a character a header value cannot carry")
    return key


def _key_list(text: str) -> tuple[str, ...]:
    """Comma-separated keys (lowproxy/keys.py); never echoed in an error."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "PD_PROXY_HOST", "--host", stripped, "0.0.0.0", "address to listen on"),
    Setting("port", "PD_PROXY_PORT", "--port", int_in(0, 65535), "8000", "port to listen on"),
    Setting(
        "prefill", "PD_PROXY_PREFILL_URL", "--prefill", endpoints, "",
        "prefill backend URL(s), comma-separated; http://, https://, dns+http://, "
        "dns+https://; #bootstrap_port=N overrides the bootstrap port of one endpoint; "
        "empty: no prefill, decode computes prompts itself", repeatable=True,
    ),
    Setting(
        "decode", "PD_PROXY_DECODE_URL", "--decode", endpoints, "",
        "decode backend URL(s), comma-separated, same syntax", repeatable=True,
    ),
    Setting(
        "ca_file", "PD_PROXY_CA_FILE", "--ca-file", stripped, "",
        "CA bundle trusted (exclusively) for https:// backends; re-read when the file "
        "changes; empty: the system trust store",
    ),
    Setting(
        "residency_timeout", "PD_PROXY_RESIDENCY_TIMEOUT_SECONDS", "--residency-timeout",
        any_float, "2", "accepted for compatibility with the GCO proxy (any number it "
        "took, inf, nan and negatives included); the residency store is never on the "
        "request path",
    ),
    Setting(
        "no_decode_status", "PD_PROXY_NO_DECODE_BACKEND_STATUS", "--no-decode-status",
        status_value, "503", "status answered when no decode backend can be reached",
    ),
    Setting(
        "no_decode_message", "PD_PROXY_NO_DECODE_BACKEND_MESSAGE", "--no-decode-message",
        text_value, "no available decode backend", "error message answered with that status",
    ),
    Setting(
        "admin_api_key", "ADMIN_API_KEY", "--admin-api-key", _backend_key, "",
        "key for POST .../instances/add (x-admin-api-key or Authorization: Bearer); "
        "empty: the admin path always answers 403",
    ),
    # -- keys (lowproxy/keys.py): sent to backends, required of clients
    Setting(
        "backend_api_key", "PD_PROXY_BACKEND_API_KEY", "--backend-api-key", _backend_key, "",
        "sent as authorization: Bearer <key> on every leg to prefill and decode and on "
        "lowproxy's own requests to them (vLLM --api-key); never to a bootstrap server",
    ),
    Setting(
        "backend_api_key_file", "PD_PROXY_BACKEND_API_KEY_FILE", "--backend-api-key-file",
        stripped, "", "file holding the backend key; re-read when the file changes",
    ),
    Setting(
        "forward_authorization", "PD_PROXY_FORWARD_AUTHORIZATION", "--forward-authorization",
        bool_value, "0", "forward the client's own authorization header to both legs "
        "(not with a backend key)",
    ),
    Setting(
        "client_api_keys", "PD_PROXY_CLIENT_API_KEYS", "--client-api-keys", _key_list, "",
        "keys clients must send as authorization: Bearer <key>, comma-separated; "
        "empty: no client key needed", repeatable=True,
    ),
    Setting(
        "client_api_keys_file", "PD_PROXY_CLIENT_API_KEYS_FILE", "--client-api-keys-file",
        stripped, "", "file of client keys, one per line; re-read when the file changes",
    ),
    # -- end of keys
    Setting("log_level", "PD_PROXY_LOG_LEVEL", "--log-level", choice(*_LOG_LEVELS), "info",
            "log level: " + ", ".join(_LOG_LEVELS)),
    Setting("log_format", "PD_PROXY_LOG_FORMAT", "--log-format", choice("text", "json"),
            "text", "log line format: text or json"),
    Setting(
        "prefill_timeout", "PD_PROXY_PREFILL_TIMEOUT_SECONDS", "--prefill-timeout",
        _positive_seconds, "300", "bound on the whole prefill leg (and the relay of its answer)",
    ),
    Setting(
        "connect_timeout", "PD_PROXY_CONNECT_TIMEOUT_SECONDS", "--connect-timeout",
        _positive_seconds, "5", "bound on opening one upstream connection (TCP and TLS)",
    ),
    Setting(
        "decode_timeout", "PD_PROXY_DECODE_TIMEOUT_SECONDS", "--decode-timeout",
        optional_seconds, "0", "bound on a whole decode response; 0: none (generations "
        "are long)",
    ),
    Setting(
        "decode_first_byte_timeout", "PD_PROXY_DECODE_FIRST_BYTE_TIMEOUT_SECONDS",
        "--decode-first-byte-timeout", optional_seconds, "0",
        "bound on decode's response head (504 when it passes); 0: none (a Mooncake decode "
        "answers once the KV has arrived)",
    ),
    Setting(
        "kv_protocol", "PD_PROXY_KV_PROTOCOL", "--kv-protocol",
        choice("relay", "mooncake", "sglang"), "relay",
        "KV handshake: relay (prefill then decode, prefill's kv_transfer_params relayed), "
        "mooncake (vLLM 0.16+ concurrent bootstrap), sglang",
    ),
    Setting(
        "on_prefill_failure", "PD_PROXY_ON_PREFILL_FAILURE", "--on-prefill-failure",
        choice("recompute", "error"), "recompute",
        "when the prefill leg fails: recompute (decode computes the prompt itself) or "
        "error (502 prefill_failed)",
    ),
    Setting(
        "rewrite_cached_tokens", "PD_PROXY_REWRITE_CACHED_TOKENS", "--rewrite-cached-tokens",
        bool_value, "1", "put the prefill's cached prompt-token count in decode's usage "
        "(the prefill's figure is the truth; a Mooncake decode reports the pulled prompt)",
    ),
    Setting(
        "forward_prompt_token_ids", "PD_PROXY_FORWARD_PROMPT_TOKEN_IDS",
        "--forward-prompt-token-ids", bool_value, "0",
        "relay, chat: the prefill leg asks return_token_ids and decode gets the prompt's "
        "token ids in kv_transfer_params (tokenize once; vLLM 0.31+ only)",
    ),
    Setting(
        "mooncake_bootstrap_port", "PD_PROXY_MOONCAKE_BOOTSTRAP_PORT",
        "--mooncake-bootstrap-port", int_in(1, 65535), "8998",
        "port of the prefill's Mooncake bootstrap server (GET /query)",
    ),
    Setting(
        "sglang_bootstrap_port", "PD_PROXY_SGLANG_BOOTSTRAP_PORT", "--sglang-bootstrap-port",
        int_in(1, 65535), "8998", "SGLang disaggregation bootstrap port sent to both legs",
    ),
    Setting(
        "sglang_admin_api_key", "PD_PROXY_SGLANG_ADMIN_API_KEY", "--sglang-admin-api-key",
        _backend_key, "", "sglang: the key of SGLang's --admin-api-key, sent as "
        "authorization: Bearer <key> on the proxy's POST /abort_request (once set, SGLang "
        "takes only that key there); empty: the legs' own authorization",
    ),
    Setting(
        "dns_refresh", "PD_PROXY_DNS_REFRESH_SECONDS", "--dns-refresh", seconds_value, "10",
        "how often dns+ endpoints are resolved again",
    ),
    Setting(
        "prefill_header_allow", "PD_PROXY_PREFILL_HEADER_ALLOW", "--prefill-header-allow",
        allow_list, "", "hosts, host:port pairs or CIDRs a x-prefiller-host-port header "
        "may name; empty: the header is ignored", repeatable=True,
    ),
    # -- routing like a scheduler (issue 15): health, models, prefill choice
    Setting(
        "health_interval", "PD_PROXY_HEALTH_INTERVAL_SECONDS", "--health-interval",
        seconds_value, "5", "how often each prefill and decode endpoint gets GET /health and "
        "GET /v1/models; 0: no checks and no model lists (nothing sent of lowproxy's own)",
    ),
    Setting(
        "health_timeout", "PD_PROXY_HEALTH_TIMEOUT_SECONDS", "--health-timeout",
        _positive_seconds, "2", "bound on one health check or model list request",
    ),
    Setting(
        "health_failures", "PD_PROXY_HEALTH_FAILURES", "--health-failures", int_in(1, 1000),
        "2", "failed checks in a row that take an endpoint out (one success brings it back)",
    ),
    Setting(
        "prefill_policy", "PD_PROXY_PREFILL_POLICY", "--prefill-policy",
        choice("cache-aware", "affinity", "least-loaded", "round-robin"), "cache-aware",
        "prefill choice without a scheduler header: cache-aware (the endpoint holding the "
        "longest cached prefix, balanced by queued uncached tokens), affinity (prompt "
        "prefix on a ring, bounded loads), least-loaded (outstanding prompt bytes) or "
        "round-robin",
    ),
    Setting(
        "affinity_slack", "PD_PROXY_AFFINITY_SLACK", "--affinity-slack", _ratio, "0.25",
        "affinity: no prefill endpoint above (1 + slack) x the average outstanding prompt "
        "bytes; cache-aware: home keeps a request within (1 + slack) x the least queued "
        "work plus the allowance",
    ),
    Setting(
        "prefix_block_bytes", "PD_PROXY_PREFIX_BLOCK_BYTES", "--prefix-block-bytes",
        int_in(16, 1 << 20), "512",
        "cache-aware: bytes of rendered prompt per remembered block (4 bytes a token)",
    ),
    Setting(
        "prefix_cache_tokens", "PD_PROXY_PREFIX_CACHE_TOKENS", "--prefix-cache-tokens",
        int_in(1, 1 << 40), "262144",
        "cache-aware: tokens of prompt remembered per endpoint (about its prefix cache's "
        "size), oldest forgotten first",
    ),
    Setting(
        "cache_allowance_tokens", "PD_PROXY_CACHE_ALLOWANCE_TOKENS",
        "--cache-allowance-tokens", int_in(0, 1 << 40), "4096",
        "cache-aware: queued uncached tokens above the least loaded prefill that are no "
        "imbalance",
    ),
    Setting(
        "decode_first_tokens", "PD_PROXY_DECODE_FIRST_TOKENS", "--decode-first-tokens",
        int_in(0, 1 << 40), "0",
        "cache-aware: skip the prefill leg (reason decode-cached) when the decode that "
        "served the conversation lacks fewer tokens than this (estimated); 0: never; "
        "never under sglang",
    ),
    Setting(
        "decode_allowance", "PD_PROXY_DECODE_ALLOWANCE", "--decode-allowance",
        int_in(0, 1 << 20), "4",
        "cache-aware: requests in flight above the least loaded decode that a "
        "conversation's decode may have and still take its next turn",
    ),
    Setting(
        "min_prefill_prompt_bytes", "PD_PROXY_MIN_PREFILL_PROMPT_BYTES",
        "--min-prefill-prompt-bytes", int_in(0, 2**40), "0",
        "prompts with less text than this go to decode alone (prefill skipped, reason "
        "short); 0: always disaggregate",
    ),
    Setting(
        "peers", "PD_PROXY_PEERS", "--peers", peer_endpoints, "",
        "cache-aware: the other proxy replicas (http://host:port, comma-separated, or "
        "dns+http://name:port), told every prefill choice made here and telling theirs, so "
        "that replicas taking turns follow one another's legs; empty: nothing shared",
        repeatable=True,
    ),
    # -- end of routing
    Setting(
        "upstream_keepalive", "PD_PROXY_UPSTREAM_KEEPALIVE", "--upstream-keepalive", bool_value,
        "1", "keep upstream connections alive in a pool; 0: one connection per call",
    ),
    Setting(
        "upstream_max_requests", "PD_PROXY_UPSTREAM_MAX_REQUESTS", "--upstream-max-requests",
        int_in(1, 10**9), "1000", "requests one pooled connection serves before it retires",
    ),
    Setting(
        "upstream_max_age", "PD_PROXY_UPSTREAM_MAX_AGE_SECONDS", "--upstream-max-age",
        seconds_value, "30", "age at which a pooled connection retires (kube-proxy balances "
        "connections, not requests)",
    ),
    Setting(
        "upstream_idle", "PD_PROXY_UPSTREAM_IDLE_SECONDS", "--upstream-idle", seconds_value, "4",
        "how long an idle pooled connection is kept (below the 5 s keep-alive of vLLM's server, "
        "so the proxy, not the backend, ends idle connections)",
    ),
    Setting(
        "max_header_bytes", "PD_PROXY_MAX_HEADER_BYTES", "--max-header-bytes",
        int_in(1024, 16 * 1024 * 1024), str(64 * 1024),
        "request line plus headers larger than this: 431",
    ),
    Setting(
        "max_body_bytes", "PD_PROXY_MAX_BODY_BYTES", "--max-body-bytes",
        int_in(0, 2**40), str(32 * 1024 * 1024), "request body larger than this: 413",
    ),
    Setting(
        "header_timeout", "PD_PROXY_HEADER_TIMEOUT_SECONDS", "--header-timeout", seconds_value,
        "30", "a request's head must arrive within this many seconds (408)",
    ),
    Setting(
        "tls_handshake_timeout", "PD_PROXY_TLS_HANDSHAKE_TIMEOUT_SECONDS",
        "--tls-handshake-timeout", _positive_seconds, "10",
        "a client's TLS handshake must end within this many seconds of its accept (the "
        "connection counts toward PD_PROXY_MAX_CONNECTIONS meanwhile)",
    ),
    Setting(
        "keepalive_timeout", "PD_PROXY_KEEPALIVE_SECONDS", "--keepalive", seconds_value, "75",
        "idle client keep-alive connections are closed after this many seconds",
    ),
    Setting(
        "client_write_timeout", "PD_PROXY_CLIENT_WRITE_TIMEOUT_SECONDS",
        "--client-write-timeout", seconds_value, "60",
        "a client that takes nothing of a full write buffer for this many seconds is taken "
        "as gone and its decode leg closed (nginx's send_timeout); 0: never",
    ),
    Setting(
        "max_connections", "PD_PROXY_MAX_CONNECTIONS", "--max-connections",
        int_in(1, 10**7), "10000", "open client connections (counted from accept, TLS "
        "handshakes included) beyond this get 503, or are closed at once on the HTTPS port",
    ),
    Setting(
        "drain_seconds", "PD_PROXY_DRAIN_SECONDS", "--drain", seconds_value, "25",
        "on SIGTERM/SIGINT, how long in-flight requests may finish",
    ),
    Setting(
        "metrics_port", "PD_PROXY_METRICS_PORT", "--metrics-port", int_in(0, 65535), "0",
        "serve /metrics on this port only (and /healthz, /readyz; plain HTTP); 0: /metrics "
        "on the main listener",
    ),
    Setting("trace", "PD_PROXY_TRACE", "--trace", bool_value, "0",
            "start a W3C trace id for requests that carry none"),
    Setting("otel", "PD_PROXY_OTEL", "--otel", bool_value, "0",
            "emit OpenTelemetry spans (llm-d attribute names) when opentelemetry-api is "
            "installed"),
    Setting("loop", "PD_PROXY_LOOP", "--loop", choice("auto", "asyncio", "uvloop"), "auto",
            "event loop: uvloop when installed (auto), or force one"),
    Setting("workers", "PD_PROXY_WORKERS", "--workers", int_in(1, 256), "1",
            "worker processes serving the port (bound once by the parent; a worker that "
            "dies is restarted)"),
    Setting("demo_args", "PD_PROXY_DEMO_ARGS", "--demo-args", words, "",
            "with --demo: the demo backends' own options, as python -m lowproxy.demo takes "
            "them (such as '--enable-scale-out --eos-first 0.05')"),
    # -- client-side TLS (issue 13)
    Setting("tls_cert_file", "PD_PROXY_TLS_CERT_FILE", "--tls-cert-file", stripped, "",
            "certificate chain (PEM) to serve HTTPS on the main port with; re-read when "
            "the file changes; empty: plain HTTP"),
    Setting("tls_key_file", "PD_PROXY_TLS_KEY_FILE", "--tls-key-file", stripped, "",
            "private key (PEM) of PD_PROXY_TLS_CERT_FILE"),
    Setting("tls_client_ca_file", "PD_PROXY_TLS_CLIENT_CA_FILE", "--tls-client-ca-file",
            stripped, "", "require client certificates signed by this CA bundle (mTLS); "
            "empty: none asked for"),
)


__all__ = ["SETTINGS"]
