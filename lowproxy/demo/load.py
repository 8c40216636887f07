"""The demo backend's engine load: prefill time, queue, and what vLLM reports of them.

A real engine computes the prompt tokens its prefix cache does not hold, and
requests queue for that compute; the bench (bench/load_prefix.py) times a
trace on that, so a router that follows the cache is seen to be faster, not
only to hit more. With ``--prefill-us-per-token`` above 0, each request's
uncached tokens cost that many microseconds, one request computing at a time
per process (the others wait: ``num_requests_waiting``).

What vLLM 0.33 tells of its load is reported alike: ``GET /metrics`` with the gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and the prefix-cache counters (tokens), and an
ORCA ``endpoint-load-metrics`` header on a non-streamed answer whose request
asked for one (``endpoint-load-metrics-format: TEXT`` or ``JSON``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class EngineLoad:
    """One demo process's queue and counters; tokens are the demo's (one per word)."""

    def __init__(self, us_per_token: float = 0.0, cache_tokens: int = 65536) -> None:
        self.us_per_token = us_per_token
        self.cache_tokens = max(1, cache_tokens)  # the KV cache's size, for kv usage
        self.in_flight = 0  # generation requests being handled
        self.waiting = 0  # of which queued for the compute
        self.active_tokens = 0  # prompt tokens of the requests in the engine: their KV
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0     # of which cached
        self.requests = 0
        self.computed = 0  # prompt tokens computed (not cached, not pulled)
        self._compute = asyncio.Lock()

    def looked_up(self, tokens: int, cached: int) -> None:
        self.requests += 1
        self.queries += tokens
        self.hits += cached

    async def compute(self, cache: Any, prompts: list[list[int]]) -> int:
        """Compute the prompts in turn with other requests; prompt 0's cached tokens.

        The cache (kv.PrefixCache) is looked up when this request's turn
        comes and filled as soon as it is computed, as vLLM's scheduler does.
        """
        if self.us_per_token <= 0:
            return self._computed(cache, prompts)
        self.waiting += 1
        queued = True
        try:
            async with self._compute:
                self.waiting -= 1
                queued = False
                cached = cache.lookup(prompts[0])
                uncached = sum(len(prompt) for prompt in prompts) - cached
                await asyncio.sleep(max(0, uncached) * self.us_per_token / 1e6)
                self._computed(cache, prompts, cached)
                return cached
        finally:
            if queued:  # cancelled while waiting its turn
                self.waiting -= 1

    def _computed(self, cache: Any, prompts: list[list[int]], cached: int | None = None) -> int:
        if cached is None:
            cached = cache.lookup(prompts[0])
        self.looked_up(len(prompts[0]), cached)
        self.computed += sum(len(prompt) for prompt in prompts) - cached
        for prompt in prompts:
            cache.insert(prompt)
        return cached

    @property
    def running(self) -> int:
        return max(0, self.in_flight - self.waiting)

    def kv_usage(self) -> float:
        return min(1.0, self.active_tokens / self.cache_tokens)

    def orca_header(self, wanted: bytes | None) -> list[tuple[bytes, bytes]]:
        """The ORCA load report vLLM adds when the request asked for one."""
        if wanted is None:
            return []
        kind = wanted.strip().upper()
        usage, waiting = round(self.kv_usage(), 4), self.waiting
        if kind == b"TEXT":
            value = (f"TEXT named_metrics.kv_cache_usage_perc={usage}, "
                     f"named_metrics.num_requests_waiting={waiting}")
        elif kind == b"JSON":
            value = "JSON " + json.dumps({"named_metrics": {
                "kv_cache_usage_perc": usage, "num_requests_waiting": waiting}})
        else:
            return []
        return [(b"endpoint-load-metrics", value.encode())]

    def metrics_text(self, model: str) -> bytes:
        """GET /metrics, with vLLM's names for what the proxy and the bench read."""
        label = f'{{model_name="{model}",engine="0"}}'
        rows = (("vllm:num_requests_running", "gauge", self.running),
                ("vllm:num_requests_waiting", "gauge", self.waiting),
                ("vllm:kv_cache_usage_perc", "gauge", round(self.kv_usage(), 4)),
                ("vllm:prefix_cache_queries_total", "counter", self.queries),
                ("vllm:prefix_cache_hits_total", "counter", self.hits),
                ("vllm:request_success_total", "counter", self.requests),
                ("vllm:prompt_tokens_computed_total", "counter", self.computed))
        lines = []
        for name, kind, value in rows:
            lines.append(f"# TYPE {name.removesuffix('_total')} {kind}")
            lines.append(f"{name}{label} {float(value)}")
        return ("\n".join(lines) + "\n").encode()


__all__ = ["EngineLoad"]
