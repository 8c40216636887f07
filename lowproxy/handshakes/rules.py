"""vLLM's rules for a handed-off request, as pure functions of the client's body.

Checked against the vLLM 0.33 source (its failure semantics for a
disaggregated request): which fields the prefill leg must not carry, which requests
decode rejects in its request model (a prefill KV computed for such a request
is never read and stays pinned: 480 s under Mooncake, 30 s under NIXL), and
which requests cannot be handed off at all (decode recomputes the prompt, or
cannot use the transferred KV). No I/O here.
"""

from __future__ import annotations

from typing import Any

from .._types import Body
from ..lax_types import is_true
from ..routes import CHAT, COMPLETIONS, GENERATE, RESPONSES

# The fields the prefill leg drops, and why (the README's table is this one).
PREFILL_DROPPED: dict[str, str] = {
    "stream_options": "vLLM rejects it without stream, and the prefill leg does not stream",
    "min_tokens": "a minimum above the one-token cap is rejected",
    "min_completion_tokens": "a minimum above the one-token cap is rejected",
    "stop_token_ids": "a listed id (EOS included) ends the prefill as stopped, and Mooncake "
                      "then frees the KV: decode waits 480 s for it",
    "stop": "a one-token answer holding a stop string stops the same way",
    "logprobs": "computed for the one prefill token and thrown away",
    "top_logprobs": "computed for the one prefill token and thrown away",
    "logprob_token_ids": "vLLM refuses it without logprobs, which the prefill leg drops "
                         "(and it too would be computed and thrown away)",
}

# The Responses API (vLLM 0.33): the cap is max_output_tokens; a stored one-token
# response would be kept for ever, so the prefill leg sends store: false.
RESPONSES_PREFILL_DROPPED: dict[str, str] = {
    "stop_token_ids": PREFILL_DROPPED["stop_token_ids"],
    "stop": PREFILL_DROPPED["stop"],
    "top_logprobs": PREFILL_DROPPED["top_logprobs"],
}
# The Anthropic Messages API: vLLM drops unknown fields there, so ignore_eos
# cannot be sent (under Mooncake an EOS first token still frees the KV).
MESSAGES_PREFILL_DROPPED: dict[str, str] = {
    "stop_sequences": "a one-token answer that matches one stops the prefill, as stop does",
}
# vLLM's generate API: the sampling rules live inside sampling_params.
GENERATE_SAMPLING_DROPPED: dict[str, str] = {
    key: PREFILL_DROPPED[key] for key in ("min_tokens", "stop_token_ids", "stop", "logprobs")}

# Reasons a request goes to decode alone, as the metric's reason label.
LIST_PROMPTS = "list-prompts"
BEAM_SEARCH = "beam-search"
ECHO = "echo"
PROMPT_LOGPROBS = "prompt-logprobs"
STORED_CONVERSATION = "stored-conversation"
BACKGROUND = "background"
NO_SAMPLING_PARAMS = "no-sampling-params"
SHORT = "short"  # PD_PROXY_MIN_PREFILL_PROMPT_BYTES
NO_HEALTHY_DECODE = "no-healthy-decode"  # told by dispatch: no decode healthy and not cooling down


def too_short(prompt_bytes: int | None, minimum: int) -> bool:
    """A prompt with less text than ``minimum`` bytes: computing it on decode costs
    less than a KV transfer. An unmeasurable prompt (None) is never short."""
    return minimum > 0 and prompt_bytes is not None and prompt_bytes < minimum


def decode_would_reject(body: Body, surface: str = CHAT) -> tuple[str, str] | None:
    """(param, message) for a request decode rejects in its request model; else None.

    Answered 400 before either leg: prefill would accept it (its leg drops the
    offending field) and compute a KV that nobody reads and vLLM never frees.
    These are chat and completions rules: the other surfaces' request models
    have no such fields (Responses has no stream_options; generate accepts
    stream_options without stream).
    """
    if surface not in (CHAT, COMPLETIONS):
        return None
    # Truthiness of the raw values, as vLLM's "before" validators test them (they
    # run before pydantic coerces the fields): {} is no stream_options there, and
    # "false" is a true stream.
    stream = bool(body.get("stream"))
    if body.get("stream_options") and not stream:
        return "stream_options", "Stream options can only be defined when stream=True."
    prompt_logprobs = body.get("prompt_logprobs")
    if stream and isinstance(prompt_logprobs, (int, float)) \
            and (prompt_logprobs > 0 or prompt_logprobs == -1):
        # vLLM's check_logprobs: 0 (no prompt logprobs) streams; any other value it
        # refuses anyway (not a number, or below -1), by a rule of its own.
        return "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."
    min_tokens = body.get("min_tokens")
    cap = body.get("max_completion_tokens")
    if cap is None:
        cap = body.get("max_tokens")
    if isinstance(min_tokens, int) and isinstance(cap, int) and _is_int(min_tokens) \
            and _is_int(cap) and min_tokens > cap:
        return "min_tokens", (f"min_tokens ({min_tokens}) must be less than or equal to "
                              f"max_tokens ({cap}).")
    return None


def cannot_hand_off(surface: str, body: Body) -> str | None:
    """Why this request must go to decode alone (with no kv_transfer_params); else None."""
    if surface == RESPONSES:
        if body.get("previous_response_id") or body.get("conversation"):
            # The conversation lives in the decode server's response store; the
            # prefill server does not hold it.
            return STORED_CONVERSATION
        if body.get("background"):
            return BACKGROUND
        return None
    if surface == GENERATE:
        # sampling_params is required: decode answers the client's mistake itself,
        # and no prefill leg is invented for it.
        sampling = body.get("sampling_params")
        if not isinstance(sampling, dict):
            return NO_SAMPLING_PARAMS
        # Prompt logprobs make decode recompute the prompt, as at the top level.
        return PROMPT_LOGPROBS if sampling.get("prompt_logprobs") is not None else None
    if surface not in (CHAT, COMPLETIONS):
        return None
    if surface == COMPLETIONS and _several_prompts(body.get("prompt")):
        # vLLM answers kv_transfer_params for prompt 0 only and gives every
        # sub-request the same params (Mooncake: one transfer_id for all).
        return LIST_PROMPTS
    # As vLLM's pydantic reads them: "true", 1, "yes"... are True there too.
    if is_true(body.get("use_beam_search")):
        return BEAM_SEARCH  # beam search drops kv_transfer_params entirely
    if is_true(body.get("echo")):
        return ECHO  # decode skips prefix-cache reads and recomputes the prompt
    if body.get("prompt_logprobs") is not None:
        return PROMPT_LOGPROBS  # likewise
    return None


def _several_prompts(prompt: Any) -> bool:
    """More than one prompt: a list of strings or of token-id lists, with two or more.

    A list of integers is one prompt, in token ids.
    """
    if not isinstance(prompt, list) or len(prompt) < 2:
        return False
    return all(isinstance(item, (str, list)) for item in prompt)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
