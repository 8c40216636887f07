"""What vLLM's request models refuse in the fields the prefill leg drops or overwrites.

The prefill leg cleans such a field off (legs.py: ``stop``, ``logprobs``, ...
dropped; ``max_tokens``, ``n``, ``stream``, ``ignore_eos`` set to its own), so
a value there that vLLM's request model refuses reaches decode alone: prefill
accepts and computes a KV, decode answers 400 from its pydantic model, before
its handler, so vLLM never tells the KV connector, and the KV stays pinned
(480 s under Mooncake, 30 s and more under NIXL). Such a request is answered
400 before either leg. Everything vLLM accepts must pass: the field types are
vLLM 0.33's declarations (chat_completion/protocol.py, completion/protocol.py,
responses/protocol.py, anthropic/protocol.py, serve/disagg/protocol.py), each
read with pydantic's lax conversions (lax_types), and the value rules are its
"before" model validators (they read the raw JSON, before any coercion).

Range rules vLLM raises later, in its handler (SamplingParams._verify_args from
to_sampling_params, inside create_*: n >= 1, max_tokens >= 1, min_tokens >= 0
and <= max_tokens, top_logprobs <= max_logprobs, the context length), release
the KV there, so they are not checked here. Pure, no I/O.
"""

from __future__ import annotations

from typing import Any, Callable

from .._types import Body
from ..lax_types import as_int, is_bool, is_int, is_int_list, is_str_list
from ..routes import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES


class FieldType:
    """A field's declared type: what pydantic accepts there, and how to word a refusal.

    ``plain``: the value types accepted as they are (an int for an int field,
    None for an optional one), told by one ``type(value) in plain`` before the
    lax rules are asked: almost every client sends those, and this runs on
    every generation request.
    """

    __slots__ = ("accepts", "wanted", "plain")

    def __init__(self, wanted: str, accepts: Callable[[Any], bool], optional: bool,
                 plain: tuple[type, ...] = ()) -> None:
        self.wanted = wanted
        self.accepts = (lambda value: value is None or accepts(value)) if optional else accepts
        self.plain = frozenset((*plain, type(None)) if optional else plain)


def _stop(value: Any) -> bool:
    return type(value) is str or is_str_list(value)


def _number_int(value: Any) -> bool:
    """An int field that vLLM's check_logprobs first requires to be a JSON number
    (it compares it before pydantic coerces it): "3" is refused there."""
    return type(value) in (int, float, bool) and is_int(value)


def _stream_options(value: Any) -> bool:
    """StreamOptions: an object; its two known fields ``bool | None``, others allowed."""
    return type(value) is dict and all(
        value.get(key) is None or is_bool(value[key])
        for key in ("include_usage", "continuous_usage_stats"))


INT = FieldType("an integer", is_int, optional=False, plain=(int,))
OPTIONAL_INT = FieldType("an integer", is_int, optional=True, plain=(int,))
BOOL = FieldType("a boolean", is_bool, optional=False, plain=(bool,))
OPTIONAL_BOOL = FieldType("a boolean", is_bool, optional=True, plain=(bool,))
STOP = FieldType("a string or a list of strings", _stop, optional=True, plain=(str,))
OPTIONAL_STR_LIST = FieldType("a list of strings", is_str_list, optional=True)
OPTIONAL_INT_LIST = FieldType("a list of integers", is_int_list, optional=True)
STREAM_OPTIONS = FieldType("an object of boolean options", _stream_options, optional=True)
LOGPROBS_COUNT = FieldType("an integer", _number_int, optional=True)

# Per surface, each field the prefill leg drops or overwrites, with vLLM's type.
# An absent field takes its default, which the model accepts. (``int`` without
# None: vLLM declares it so, and an explicit null is refused.) Not here:
# min_completion_tokens (no vLLM field: ignored, whatever it holds) and the
# length of ``stop`` (VLLM_MAX_STOP_STRINGS, the server's own setting).
_SHARED: dict[str, FieldType] = {
    "max_tokens": OPTIONAL_INT,
    "stream": OPTIONAL_BOOL,
    "ignore_eos": BOOL,
    "min_tokens": INT,
    "stop": STOP,
    "stop_token_ids": OPTIONAL_INT_LIST,
    "stream_options": STREAM_OPTIONS,
}
FIELD_TYPES: dict[str, dict[str, FieldType]] = {
    CHAT: {**_SHARED, "max_completion_tokens": OPTIONAL_INT, "n": OPTIONAL_INT,
           "logprobs": OPTIONAL_BOOL, "top_logprobs": LOGPROBS_COUNT,
           "logprob_token_ids": OPTIONAL_INT_LIST},
    COMPLETIONS: {**_SHARED, "n": INT, "logprobs": LOGPROBS_COUNT,
                  "logprob_token_ids": OPTIONAL_INT_LIST},
    RESPONSES: {"max_output_tokens": OPTIONAL_INT, "store": OPTIONAL_BOOL,
                "stream": OPTIONAL_BOOL, "ignore_eos": BOOL, "stop": STOP,
                "top_logprobs": OPTIONAL_INT},  # int | None, no before-validator there
    MESSAGES: {"max_tokens": INT, "stream": OPTIONAL_BOOL, "stop_sequences": OPTIONAL_STR_LIST},
    # GenerateRequest: the top level by type; inside sampling_params, vLLM's
    # SamplingParams (msgspec) checks values in _verify_args: _sampling_rules.
    GENERATE: {"stream": OPTIONAL_BOOL},
}


def refused_field(body: Body, surface: str) -> tuple[str, str] | None:
    """(param, message) when vLLM's request model refuses a field the prefill leg
    cleans off; else None."""
    types = FIELD_TYPES.get(surface)
    if types is None:
        return None
    if surface == MESSAGES and "max_tokens" not in body:
        return "max_tokens", "'max_tokens' is required."  # the prefill leg would set 1
    get, refused = types.get, None
    for field, value in body.items():  # a body holds a handful of fields: only those
        kind = get(field)
        if kind is not None and type(value) not in kind.plain and not kind.accepts(value):
            refused = [field] if refused is None else [*refused, field]
    if refused is not None:
        # The first refused in the declared order, whatever the body's order (each
        # field is checked once: a long list is not walked twice).
        field = min(refused, key=list(types).index)
        return field, f"'{field}' must be {types[field].wanted}."
    return _value_rules(body, surface)


def _value_rules(body: Body, surface: str) -> tuple[str, str] | None:
    """vLLM's "before" validators on the fields the prefill leg cleans off (the
    types are already checked), in its words."""
    if surface == MESSAGES:
        if (as_int(body["max_tokens"]) or 0) <= 0:  # a field_validator of its own
            return "max_tokens", "max_tokens must be positive"
        return None
    if surface == GENERATE:
        sampling = body.get("sampling_params")
        return _sampling_rules(sampling) if type(sampling) is dict else None
    if (refused := _logprob_token_ids(body, surface)) is not None:
        return "logprob_token_ids", refused
    if surface == CHAT:
        top = body.get("top_logprobs")
        if top is not None:
            if _negative(top):
                return "top_logprobs", "`top_logprobs` must be a positive value or -1."
            if (top == -1 or top > 0) and not body.get("logprobs"):
                return "top_logprobs", ("when using `top_logprobs`, `logprobs` must be set "
                                        "to true.")
    elif surface == COMPLETIONS and _negative(body.get("logprobs")):
        return "logprobs", "`logprobs` must be a positive value or -1."
    return None


def _sampling_rules(params: Body) -> tuple[str, str] | None:
    """SamplingParams._verify_args on what the generate prefill leg sets or drops
    (max_tokens, n, min_tokens, logprobs, stop), in its words; plain values only
    (what msgspec makes of others is its own)."""
    cap: Any = params.get("max_tokens")
    least: Any = params.get("min_tokens")
    n: Any = params.get("n")
    logprobs: Any = params.get("logprobs")
    if _is_int(n) and n < 1:
        return "n", f"n must be at least 1, got {n}."
    if _is_int(cap) and cap < 1:
        return "max_tokens", f"max_tokens must be at least 1, got {cap}."
    if _is_int(least):
        if least < 0:
            return "min_tokens", f"min_tokens must be greater than or equal to 0, got {least}."
        if _is_int(cap) and least > cap:
            return "min_tokens", (f"min_tokens must be less than or equal to "
                                  f"max_tokens={cap}, got {least}.")
    if _is_int(logprobs) and logprobs < 0 and logprobs != -1:
        return "logprobs", f"logprobs must be non-negative, got {logprobs}."
    stop = params.get("stop")
    if stop == "" or (type(stop) is list and "" in stop):
        return "stop", "stop cannot contain an empty string."
    return None


def _is_int(value: Any) -> bool:
    return type(value) is int


def _logprob_token_ids(body: Body, surface: str) -> str | None:
    """Why vLLM's check_logprobs refuses ``logprob_token_ids`` (a list by now), or None."""
    ids = body.get("logprob_token_ids")
    if ids is None:
        return None
    if not ids:  # also its Field(min_length=1)
        return "`logprob_token_ids` must not be an empty list."
    if body.get("use_beam_search"):
        return "`logprob_token_ids` is not supported with beam search."
    if surface == CHAT:
        if not body.get("logprobs"):
            return "when using `logprob_token_ids`, `logprobs` must be set to true."
        return None
    if body.get("echo") and body.get("max_tokens") == 0:
        return ("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` "
                "because no output tokens are generated.")
    if body.get("logprobs") is None:
        return "when using `logprob_token_ids`, `logprobs` must be set."
    return None


def _negative(value: Any) -> bool:
    """vLLM's ``value < 0 and value != -1`` on a number it has let through."""
    return value is not None and value < 0 and value != -1
