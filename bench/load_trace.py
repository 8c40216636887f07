"""The seeded traces of the prefix scenario, and the one-big-cache reference.

Three traces, as issue 22 describes the held-out benchmark:

- ``chat``: multi-tenant chat: 20 system prompts of 1-8 KB shared by many
  conversations of 1-6 turns; each turn repeats the earlier ones, with the
  answers the demo decode gave (its answers are deterministic), so a decode's
  own cache can hold a conversation;
- ``few-shot``: completions: 10 long shared prefixes (8-16 KB) with varying
  questions;
- ``mix``: both, with one hot tenant holding a third of the conversations.

Words are three letters and a space: four bytes per demo token, the proxy's
estimate. The reference is one prefix cache of the prefills' summed size,
fed the same prompts in the order they were sent.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field

from lowproxy.demo.kv import PrefixCache, prompt_ids, render_messages, tokenize

ANSWER_TOKENS = 8
ANSWER = "".join(f"tok{i} " for i in range(ANSWER_TOKENS))  # what the demo decode says


@dataclass
class Conversation:
    """One client's requests: each turn is sent after the previous one answered."""
    path: str
    bodies: list[bytes] = field(default_factory=list)


def _words(rng: random.Random, count: int) -> str:
    letters = string.ascii_lowercase
    return " ".join("".join(rng.choice(letters) for _ in range(3)) for _ in range(count))


def _chat(rng: random.Random, systems: list[str], weights: list[float], count: int,
          ) -> list[Conversation]:
    conversations = []
    for _ in range(count):
        system = rng.choices(systems, weights)[0]
        messages = [{"role": "system", "content": system}]
        conversation = Conversation("/v1/chat/completions")
        for _turn in range(rng.randint(1, 6)):
            messages.append({"role": "user", "content": _words(rng, rng.randint(20, 80))})
            conversation.bodies.append(json.dumps(
                {"model": "demo-model", "messages": messages, "max_tokens": ANSWER_TOKENS},
                separators=(",", ":")).encode())
            messages = messages + [{"role": "assistant", "content": ANSWER}]
        conversations.append(conversation)
    return conversations


def _few_shot(rng: random.Random, prefixes: list[str], count: int) -> list[Conversation]:
    out = []
    for _ in range(count):
        prompt = rng.choice(prefixes) + "\nQ: " + _words(rng, rng.randint(10, 40)) + "\nA:"
        out.append(Conversation("/v1/completions", [json.dumps(
            {"model": "demo-model", "prompt": prompt, "max_tokens": ANSWER_TOKENS},
            separators=(",", ":")).encode()]))
    return out


def trace(name: str, seed: int = 22) -> list[Conversation]:
    """The conversations of one trace, in the order they start."""
    rng = random.Random(seed)
    systems = [_words(rng, rng.randint(256, 2048)) for _ in range(20)]  # 1-8 KB
    prefixes = [_words(rng, rng.randint(2048, 4096)) for _ in range(10)]  # 8-16 KB
    if name == "chat":
        out = _chat(rng, systems, [1.0] * len(systems), 70)
    elif name == "few-shot":
        out = _few_shot(rng, prefixes, 220)
    elif name == "mix":
        hot = [12.0] + [1.0] * (len(systems) - 1)  # tenant 0: a third of the chats
        out = _chat(rng, systems, hot, 45) + _few_shot(rng, prefixes, 90)
    else:
        raise ValueError(name)
    rng.shuffle(out)
    return out


def prompt_tokens(path: str, body: bytes) -> list[int]:
    """The demo's tokens of a request, as its prefill sees them."""
    parsed = json.loads(body)
    if path.endswith("/chat/completions"):
        return tokenize(render_messages(parsed["messages"]))
    return prompt_ids(parsed["prompt"])


def reference_hit_rate(sent: list[tuple[str, bytes]], blocks: int, block_size: int = 16,
                       ) -> float:
    """Hit rate of one cache of ``blocks`` blocks fed ``sent`` in order."""
    cache = PrefixCache(block_size, blocks)
    cached = total = 0
    for path, body in sent:
        tokens = prompt_tokens(path, body)
        cached += cache.lookup(tokens)
        total += len(tokens)
        cache.insert(tokens)
    return cached / max(total, 1)


__all__ = ["ANSWER", "Conversation", "prompt_tokens", "reference_hit_rate", "trace"]
