"""The type aliases and the one field name every layer shares, defined once."""

from __future__ import annotations

from typing import Any

Headers = list[tuple[bytes, bytes]]  # (name, value) pairs, raw bytes, in order
Body = dict[str, Any]  # a JSON object: a client's body, or one shaped for a leg
KV = "kv_transfer_params"  # the body field that tells vLLM's KV connectors what to do
