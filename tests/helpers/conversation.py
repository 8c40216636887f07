"""A conversation of chat turns behind one 300-word system prompt, and the prefill legs a
demo backend took: what the tests of replicas and workers sharing choices send."""

from __future__ import annotations

from typing import Any

CHAT = "/v1/chat/completions"
ANSWER = "tok0 tok1 tok2 tok3 "  # the demo's answer to max_tokens 4


def turns(*users: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": " ".join(f"sys{i}" for i in range(300))}]
    for index, user in enumerate(users):
        if index:
            messages.append({"role": "assistant", "content": ANSWER})
        messages.append({"role": "user", "content": user})
    return {"model": "demo-model", "messages": messages, "max_tokens": 4}


def legs_at(backend: Any) -> int:
    return sum(1 for r in backend.received if r.method == "POST" and r.path == CHAT)
