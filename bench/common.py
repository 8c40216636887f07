"""What the load and soak benchmarks share: the checkout's root, free ports, the chat body."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "demo-model"  # the model the demo backends serve


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on now (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chat_body(messages: list[dict[str, Any]], max_tokens: int, stream: bool,
              **fields: Any) -> bytes:
    """A chat completions body for the demo model, compact JSON; ``fields`` go in as is."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, **fields,
                            "messages": messages}
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()
