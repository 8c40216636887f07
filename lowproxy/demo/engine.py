"""The demo backend's engine: what a request asks for, whether vLLM accepts it,
and the tokens it generates.

The demo model is deterministic: generated token ``i`` has id
``OUTPUT_TOKEN_BASE + i`` and text ``"tok<i> "``; it keeps talking up to any
cap it is given, and without one says 16 tokens and then EOS. Asked to emulate
EOS (``eos_first``), the first token is EOS instead. Stop checks follow vLLM
v1's order (``check_stop``): nothing stops before ``min_tokens``; then EOS
unless ``ignore_eos``; then ``stop_token_ids`` (which stop even under
``ignore_eos``); then the length cap; stop strings are matched on the text
afterwards and cut it, finishing as stopped too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lax_types import as_bool, as_int
from .kv import EOS_TOKEN_ID, OUTPUT_TOKEN_BASE, prompt_ids, render_messages, tokenize

NATURAL_TOKENS = 16

CHAT, COMPLETIONS, RESPONSES, MESSAGES, GENERATE, EMBEDDINGS = (
    "chat", "completions", "responses", "messages", "generate", "embeddings")

# Route by path suffix, longest first (a gateway prefix keeps working).
ROUTES = (("/chat/completions", CHAT), ("/completions", COMPLETIONS),
          ("/responses", RESPONSES), ("/messages", MESSAGES),
          ("/inference/v1/generate", GENERATE), ("/embeddings", EMBEDDINGS))


def route_of(path: str) -> str | None:
    for suffix, route in ROUTES:
        if path.endswith(suffix):
            return route
    return None


class Problem(Exception):
    """A request vLLM refuses: status, message and the field to blame."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "BadRequestError", in_stream: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        # Raised by the engine once a stream has begun (vLLM 0.30+'s Mooncake KV
        # timeout): a streamed request gets 200, an error event, then [DONE].
        self.in_stream = in_stream


@dataclass
class Sampling:
    cap: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1


@dataclass
class Parsed:
    route: str
    sampling: Sampling
    prompts: list[list[int]]  # one per sub-request (completions may carry several)
    stream: bool = False
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Output:
    token_ids: list[int]
    pieces: list[str]  # visible text per token; "".join(pieces) is the text
    finish_reason: str  # "stop" or "length"
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def generate(sampling: Sampling, eos_first: bool = False) -> Output:
    limit = sampling.cap if sampling.cap is not None else NATURAL_TOKENS + 1
    ids: list[int] = []
    pieces: list[str] = []
    for i in range(limit):
        eos = (i == 0 and eos_first) or (sampling.cap is None and i == NATURAL_TOKENS)
        token = EOS_TOKEN_ID if eos else OUTPUT_TOKEN_BASE + i
        ids.append(token)
        pieces.append("" if eos else f"tok{i} ")
        if len(ids) < sampling.min_tokens:
            continue
        if token == EOS_TOKEN_ID and not sampling.ignore_eos:
            return _stopped(ids, pieces, sampling, None)
        if token in sampling.stop_token_ids:
            return _stopped(ids, pieces, sampling, token)
        cut = _stop_string(ids, pieces, sampling.stop)
        if cut is not None:
            return cut
    return Output(ids, pieces, "length")


def _stopped(ids: list[int], pieces: list[str], sampling: Sampling,
             reason: int | None) -> Output:
    return _stop_string(ids, pieces, sampling.stop) or Output(ids, pieces, "stop", reason)


def _stop_string(ids: list[int], pieces: list[str], stops: tuple[str, ...]) -> Output | None:
    if not stops:
        return None
    text = "".join(pieces)
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return None
    at, stop = min(hits)
    kept, used = [], 0
    for piece in pieces:
        kept.append(piece[:max(0, at - used)])
        used += len(piece)
    # The token whose text held the stop string is generated (and counted).
    return Output(ids[:len(kept)], kept, "stop", stop)


# -- what a request asks for, and vLLM's request-model checks


def _int(body: dict[str, Any], key: str) -> int | None:
    """An integer field as vLLM's pydantic reads it (lax: "3" and 3.0 are 3)."""
    value = body.get(key)
    if value is None:
        return None
    number = as_int(value)
    if number is None:
        raise Problem(400, f"{key} must be an integer", key)
    return number


def _stream(body: dict[str, Any]) -> bool:
    """``stream`` as pydantic's lax bool reads it ("false" is false)."""
    value = body.get("stream")
    if value is None:
        return False
    flag = as_bool(value)
    if flag is None:
        raise Problem(400, "stream must be a boolean", "stream")
    return flag


def _stops(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(s for s in value if isinstance(s, str)) if isinstance(value, list) else ()


def sampling_of(params: dict[str, Any], cap_keys: tuple[str, ...], stop_key: str = "stop",
                honour_extras: bool = True) -> Sampling:
    cap = None
    for key in cap_keys:  # the first present wins (chat: max_completion_tokens)
        cap = _int(params, key)
        if cap is not None:
            break
    if cap is not None and cap < 1:
        raise Problem(400, f"{cap_keys[0]} must be at least 1, got {cap}.", cap_keys[0])
    sampling = Sampling(cap=cap, stop=_stops(params.get(stop_key)))
    if honour_extras:  # vLLM's extra sampling fields; the Messages API drops them
        low = _int(params, "min_tokens") or 0
        if cap is not None and low > cap:
            raise Problem(400, f"min_tokens must be less than or equal to "
                          f"max_tokens={cap}, got {low}.", "min_tokens")
        ids = params.get("stop_token_ids") or []
        if not isinstance(ids, list):  # vLLM's request model: a list of ints
            raise Problem(400, "stop_token_ids must be a list of integers", "stop_token_ids")
        sampling.min_tokens = low
        sampling.ignore_eos = bool(params.get("ignore_eos"))
        sampling.stop_token_ids = tuple(t for t in ids if isinstance(t, int))
        sampling.n = _int(params, "n") or 1
        if sampling.n < 1:
            raise Problem(400, "n must be at least 1.", "n")
    return sampling


def _openai_checks(body: dict[str, Any]) -> None:
    """vLLM's chat/completions request-model checks a badly shaped leg trips over."""
    # vLLM's "before" validators: truthiness of the raw values ({} is no options).
    if body.get("stream_options") and not body.get("stream"):
        raise Problem(400, "Stream options can only be defined when stream=True.",
                      "stream_options")
    prompt_logprobs = body.get("prompt_logprobs")
    if body.get("stream") and isinstance(prompt_logprobs, (int, float)) \
            and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise Problem(400, "`prompt_logprobs` are not available when `stream=True`.",
                      "prompt_logprobs")
    # check_logprobs: chat wants a true logprobs, completions any (0 included).
    logprobs = body.get("logprobs")
    if body.get("logprob_token_ids") is not None and (logprobs is None or logprobs is False):
        raise Problem(400, "when using `logprob_token_ids`, `logprobs` must be set.",
                      "logprob_token_ids")
    low = _int(body, "min_completion_tokens")
    cap = _int(body, "max_completion_tokens") or _int(body, "max_tokens")
    if low is not None and cap is not None and low > cap:
        raise Problem(400, f"min_completion_tokens must be less than or equal to "
                      f"max_tokens={cap}, got {low}.", "min_completion_tokens")


def _completion_prompts(prompt: Any) -> list[list[int]]:
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return [prompt_ids(p) for p in prompt]  # several prompts: one sub-request each
    return [prompt_ids(prompt)]


def _responses_prompt(body: dict[str, Any]) -> list[int]:
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    return tokenize(render_messages(items, body.get("instructions")))


# The demo's own guard, not vLLM's: it generates every sequence in the proxy's
# process under --demo, so a client's n of a billion must not take that down.
MAX_SEQUENCES = 1024


def bounded(parsed: Parsed) -> Parsed:
    """``parsed``, unless it asks for more than MAX_SEQUENCES sequences (prompts x n)."""
    if parsed.sampling.n * len(parsed.prompts) > MAX_SEQUENCES:
        raise Problem(400, f"the demo backend generates at most {MAX_SEQUENCES} sequences "
                      "per request (prompts x n)", "n")
    return parsed


def parse(route: str, body: dict[str, Any], sglang: bool = False) -> Parsed:
    """The request as the engine sees it; raises Problem where vLLM answers 400
    (``sglang``: SGLang's server, which has not vLLM's request-model checks)."""
    return bounded(_parse(route, body, sglang))


def _parse(route: str, body: dict[str, Any], sglang: bool = False) -> Parsed:
    stream = _stream(body)
    if route in (CHAT, COMPLETIONS):
        if not sglang:
            _openai_checks(body)
        if route == CHAT:
            if "messages" not in body:
                raise Problem(400, "messages is required", "messages")
            prompts = [tokenize(render_messages(body["messages"]))]
            keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
        else:
            if "prompt" not in body:
                raise Problem(400, "prompt is required", "prompt")
            prompts, keys = _completion_prompts(body["prompt"]), ("max_tokens",)
        return Parsed(route, sampling_of(body, keys), prompts, stream)
    if route == RESPONSES:
        if "input" not in body:
            raise Problem(400, "input is required", "input")
        return Parsed(route, sampling_of(body, ("max_output_tokens",)),
                      [_responses_prompt(body)], stream)
    if route == MESSAGES:
        if _int(body, "max_tokens") is None:
            raise Problem(400, "max_tokens: Field required", "max_tokens")
        if not isinstance(body.get("messages"), list):  # AnthropicMessagesRequest's own
            raise Problem(400, "messages: Field required", "messages")
        # Converted to a chat request: fields Anthropic does not define are dropped.
        sampling = sampling_of(body, ("max_tokens",), "stop_sequences", honour_extras=False)
        prompt = tokenize(render_messages(body.get("messages"), body.get("system")))
        return Parsed(route, sampling, [prompt], stream)
    if route == GENERATE:
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            raise Problem(400, "sampling_params: Field required", "sampling_params")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise Problem(400, "token_ids: a list of integers is required", "token_ids")
        # The cap, ignore_eos, min_tokens and stop ids live in sampling_params;
        # top-level ones are not read. stream_options without stream is accepted.
        return Parsed(route, sampling_of(params, ("max_tokens",)), [list(ids)], stream)
    raise Problem(404, "Not Found")


def check_length(parsed: Parsed, max_model_len: int) -> None:
    """The context-length check vLLM makes after tokenizing (the KV is released)."""
    for prompt in parsed.prompts:
        if len(prompt) > max_model_len:
            raise Problem(400, f"This model's maximum context length is {max_model_len} "
                          f"tokens. However, your request has {len(prompt)} input tokens.",
                          "input_tokens")
        cap = parsed.sampling.cap
        if cap is not None and len(prompt) + cap > max_model_len:
            raise Problem(400, f"'max_tokens' is too large: {cap}. This model's maximum "
                          f"context length is {max_model_len} tokens and your request has "
                          f"{len(prompt)} input tokens ({cap} > {max_model_len} - "
                          f"{len(prompt)}).", "max_tokens")
