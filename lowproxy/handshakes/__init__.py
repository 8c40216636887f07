"""The KV handshakes: what a generation request becomes, leg by leg (the plan).

``planner`` picks the handshake (decode only, or a prefill leg first) and asks
``relay`` (NIXL), ``mooncake`` or ``sglang`` for its ``Plan``: the bodies, headers and
order of each leg, shaped by ``legs`` under the engines' ``rules``. Pure but for
``bootstrap``, which asks a prefill engine's bootstrap server for its engine ids
(cached). ``client_body`` parses the client's JSON once and ``backend_json``
engines' answers, both with ``strict_json``; ``usage`` rewrites cached-token counts.
"""

from .backend_json import MAX_PREFILL_ANSWER_BYTES, BadAnswer, strict_loads
from .bootstrap import BootstrapCache
from .client_body import BodyError, parse_client_body, wants_stream, without_client_kv
from .legs import Plan, decode_only_plan, serialise
from .planner import plan_generation
from .rules import decode_would_reject
from .usage import cached_tokens_of, rewrite_body, rewrite_events

__all__ = ["MAX_PREFILL_ANSWER_BYTES", "BadAnswer", "BodyError", "BootstrapCache", "Plan",
           "cached_tokens_of", "decode_only_plan", "parse_client_body", "plan_generation",
           "decode_would_reject", "rewrite_body", "rewrite_events", "serialise", "strict_loads",
           "wants_stream", "without_client_kv"]
