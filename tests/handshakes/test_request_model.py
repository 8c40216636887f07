"""request_models.refused_field: vLLM's request models on the fields the prefill leg
cleans off, as tables of values refused and accepted.

Each value is also put to a pydantic model declaring those fields as vLLM 0.33
declares them (chat_completion/protocol.py, completion/protocol.py,
responses/protocol.py, anthropic/protocol.py), so that the table itself is
held to pydantic's lax validation, not to what lowproxy believes of it. The
"before" validators vLLM adds (check_logprobs, validate_stream_options) are
value rules, restated in test_what_vllm_validators_refuse_is_refused.
"""

from __future__ import annotations

import pytest

from lowproxy.handshakes.request_models import refused_field
from lowproxy.routes import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES

pydantic = pytest.importorskip(
    "pydantic", reason="pydantic comes with the openai client of the test extra")
BaseModel, ConfigDict, Field = pydantic.BaseModel, pydantic.ConfigDict, pydantic.Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(BaseModel):  # what chat and completions declare alike
    model_config = ConfigDict(extra="allow")
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = []
    ignore_eos: bool = False
    min_tokens: int = 0


class Chat(_Sampling):  # the fields of ChatCompletionRequest the prefill leg cleans off
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1


class Completion(_Sampling):
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1


class Responses(BaseModel):
    model_config = ConfigDict(extra="allow")
    max_output_tokens: int | None = None
    store: bool | None = True
    stream: bool | None = False
    stop: str | list[str] | None = []
    ignore_eos: bool = False


class Messages(BaseModel):
    max_tokens: int = Field(gt=0)  # required; vLLM's field_validator refuses <= 0
    stop_sequences: list[str] | None = None
    stream: bool | None = False


MODELS = {CHAT: Chat, COMPLETIONS: Completion, RESPONSES: Responses, MESSAGES: Messages}


def _pydantic_refuses(surface: str, body: dict) -> bool:
    try:
        MODELS[surface].model_validate(body)
    except pydantic.ValidationError:
        return True
    return False


# (surface, field, value): refused by vLLM's model, so answered 400 before either leg.
REFUSED = [
    (CHAT, "max_tokens", "abc"), (CHAT, "max_tokens", 5.5), (CHAT, "max_tokens", [4]),
    (CHAT, "max_tokens", {}), (CHAT, "max_tokens", "4.5"), (CHAT, "max_tokens", "1e3"),
    (CHAT, "max_completion_tokens", "abc"), (CHAT, "n", "abc"), (CHAT, "n", 2.5),
    (CHAT, "stream", "maybe"), (CHAT, "stream", 2), (CHAT, "stream", " true"),
    (CHAT, "ignore_eos", "maybe"), (CHAT, "ignore_eos", None), (CHAT, "ignore_eos", 0.5),
    (CHAT, "min_tokens", "abc"), (CHAT, "min_tokens", None), (CHAT, "min_tokens", 1.5),
    (CHAT, "stop", 5), (CHAT, "stop", True), (CHAT, "stop", ["a", 5]), (CHAT, "stop", {}),
    (CHAT, "stop", [None]), (CHAT, "stop_token_ids", ["a"]), (CHAT, "stop_token_ids", 5),
    (CHAT, "stop_token_ids", [1.5]), (CHAT, "stop_token_ids", [None]),
    (CHAT, "stop_token_ids", "1,2"), (CHAT, "logprobs", "maybe"), (CHAT, "logprobs", 3),
    (CHAT, "stream_options", "yes"), (CHAT, "stream_options", []),
    (CHAT, "stream_options", {"include_usage": "maybe"}),
    (CHAT, "stream_options", {"continuous_usage_stats": 2}),
    (COMPLETIONS, "n", None), (COMPLETIONS, "n", "x"), (COMPLETIONS, "max_tokens", "x"),
    (COMPLETIONS, "ignore_eos", None), (COMPLETIONS, "stop", 0), (COMPLETIONS, "logprobs", 2.5),
    (COMPLETIONS, "stop_token_ids", [[1]]), (COMPLETIONS, "min_tokens", "1.5"),
    (RESPONSES, "max_output_tokens", "abc"), (RESPONSES, "store", "maybe"),
    (RESPONSES, "stream", [True]), (RESPONSES, "ignore_eos", None), (RESPONSES, "stop", 1),
    (MESSAGES, "max_tokens", "abc"), (MESSAGES, "max_tokens", None), (MESSAGES, "max_tokens", 0),
    (MESSAGES, "max_tokens", -3), (MESSAGES, "max_tokens", "0"), (MESSAGES, "stream", "maybe"),
    (MESSAGES, "stop_sequences", "\n"), (MESSAGES, "stop_sequences", [1]),
]
# Accepted by vLLM's model (lax: numeric text, integral floats, bools as ints, ...).
ACCEPTED = [
    (CHAT, "max_tokens", 5), (CHAT, "max_tokens", 5.0), (CHAT, "max_tokens", "5"),
    (CHAT, "max_tokens", " 5 "), (CHAT, "max_tokens", "5.0"), (CHAT, "max_tokens", True),
    (CHAT, "max_tokens", None), (CHAT, "max_tokens", "1_000"), (CHAT, "max_tokens", 0),
    (CHAT, "max_tokens", -4),  # its range is checked in vLLM's handler, which frees the KV
    (CHAT, "max_completion_tokens", "7"), (CHAT, "n", "2"), (CHAT, "n", None), (CHAT, "n", 0),
    (CHAT, "stream", "false"), (CHAT, "stream", "yes"), (CHAT, "stream", 0), (CHAT, "stream", 1.0),
    (CHAT, "stream", "ON"), (CHAT, "stream", None), (CHAT, "ignore_eos", "t"),
    (CHAT, "ignore_eos", 1), (CHAT, "min_tokens", "3"), (CHAT, "min_tokens", False),
    (CHAT, "stop", "x"), (CHAT, "stop", ""), (CHAT, "stop", []), (CHAT, "stop", ["a", "b"]),
    (CHAT, "stop", None), (CHAT, "stop_token_ids", ["5", 6.0, True]),
    (CHAT, "stop_token_ids", []), (CHAT, "stop_token_ids", None), (CHAT, "logprobs", "yes"),
    (CHAT, "logprobs", None), (CHAT, "stream_options", {"include_usage": "yes", "x": [1]}),
    (CHAT, "stream_options", None), (CHAT, "min_completion_tokens", "anything"),
    (COMPLETIONS, "n", "3"), (COMPLETIONS, "max_tokens", None), (COMPLETIONS, "logprobs", 2),
    (COMPLETIONS, "logprobs", 0), (COMPLETIONS, "logprobs", None),
    (COMPLETIONS, "max_completion_tokens", "not a completions field"),
    (RESPONSES, "max_output_tokens", "9"), (RESPONSES, "store", "no"),
    (RESPONSES, "ignore_eos", "1"), (RESPONSES, "stop", ["x"]),
    (RESPONSES, "stop_token_ids", "not declared in vLLM's Responses model"),
    (MESSAGES, "max_tokens", "5"), (MESSAGES, "max_tokens", 2.0), (MESSAGES, "stream", "false"),
    (MESSAGES, "stop_sequences", ["\n"]), (MESSAGES, "stop_sequences", None),
]


def _body(surface, field, value):
    body = {"max_tokens": 4} if surface == MESSAGES else {}
    body[field] = value
    if field == "stream_options" and value:
        body["stream"] = True  # the stream rule is not what is tested here
    return body


@pytest.mark.parametrize("surface, field, value", REFUSED)
def test_refused_values_are_named(surface, field, value):
    body = _body(surface, field, value)
    assert _pydantic_refuses(surface, body), "the table is wrong: pydantic accepts it"
    assert refused_field(body, surface) is not None
    assert refused_field(body, surface)[0] == field


@pytest.mark.parametrize("surface, field, value", ACCEPTED)
def test_accepted_values_pass(surface, field, value):
    body = _body(surface, field, value)
    assert not _pydantic_refuses(surface, body), "the table is wrong: pydantic refuses it"
    assert refused_field(body, surface) is None


def test_messages_without_max_tokens_is_refused():
    # The prefill leg would carry max_tokens: 1; decode's model requires the field.
    assert _pydantic_refuses(MESSAGES, {})
    assert refused_field({}, MESSAGES) == ("max_tokens", "'max_tokens' is required.")


@pytest.mark.parametrize("surface, body, param", [
    # check_logprobs compares the raw value before pydantic coerces it: text is refused.
    (CHAT, {"top_logprobs": "3", "logprobs": True}, "top_logprobs"),
    (CHAT, {"top_logprobs": "3x"}, "top_logprobs"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs"),  # top_logprobs > 0 needs logprobs true
    (CHAT, {"top_logprobs": -1, "logprobs": False}, "top_logprobs"),
    (CHAT, {"top_logprobs": 3, "logprobs": 0}, "top_logprobs"),
    (CHAT, {"top_logprobs": -2, "logprobs": True}, "top_logprobs"),
    (CHAT, {"top_logprobs": True}, "top_logprobs"),
    (CHAT, {"logprob_token_ids": [1]}, "logprob_token_ids"),
    (CHAT, {"logprob_token_ids": [1], "logprobs": 0}, "logprob_token_ids"),
    (CHAT, {"logprob_token_ids": [], "logprobs": True}, "logprob_token_ids"),
    (CHAT, {"logprob_token_ids": "1", "logprobs": True}, "logprob_token_ids"),
    (CHAT, {"logprob_token_ids": [1.5], "logprobs": True}, "logprob_token_ids"),
    (CHAT, {"logprob_token_ids": [1], "logprobs": True, "use_beam_search": True},
     "logprob_token_ids"),
    (COMPLETIONS, {"logprob_token_ids": [1]}, "logprob_token_ids"),
    (COMPLETIONS, {"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0},
     "logprob_token_ids"),
    (COMPLETIONS, {"logprobs": "2"}, "logprobs"),
    (COMPLETIONS, {"logprobs": -2}, "logprobs"),
    (GENERATE, {"stream": "maybe", "sampling_params": {}}, "stream"),  # bool | None
])
def test_what_vllm_validators_refuse_is_refused(surface, body, param):
    found = refused_field(body, surface)
    assert found is not None and found[0] == param


@pytest.mark.parametrize("surface, body", [
    (CHAT, {"top_logprobs": 3, "logprobs": True}),
    (CHAT, {"top_logprobs": 3.0, "logprobs": "yes"}),  # raw truthiness, then coerced
    (CHAT, {"top_logprobs": 3, "logprobs": "false"}),  # a true string to the validator
    (CHAT, {"top_logprobs": -1, "logprobs": 1}),
    (CHAT, {"top_logprobs": 0}), (CHAT, {"top_logprobs": None}),
    (CHAT, {"top_logprobs": 0.0, "logprobs": False}),
    (COMPLETIONS, {"logprobs": -1}), (COMPLETIONS, {"logprobs": 5.0}),
    (CHAT, {"logprob_token_ids": [1, "2", 3.0], "logprobs": True}),
    (CHAT, {"logprob_token_ids": [1], "logprobs": "false"}),  # truthy to check_logprobs
    (CHAT, {"logprob_token_ids": None}),
    (COMPLETIONS, {"logprob_token_ids": [7], "logprobs": 0}),
    (COMPLETIONS, {"logprob_token_ids": [7], "logprobs": 0, "echo": True, "max_tokens": "0"}),
    (CHAT, {"n": 3, "stream": True, "stop": ["\n"], "stop_token_ids": [2], "min_tokens": 1,
            "ignore_eos": False, "max_completion_tokens": 9}),
    (GENERATE, {"sampling_params": {"max_tokens": "x"}}),  # not checked there (REPORT.md)
    (GENERATE, {"stream": "yes", "stream_options": {"include_usage": True}}),
])
def test_what_vllm_validators_accept_passes(surface, body):
    assert refused_field(body, surface) is None


def test_a_long_list_is_walked_only_when_short_enough():
    """Plain ints are told at C speed however many; numeric strings (which vLLM takes)
    are walked one by one only up to MAX_LAX_ITEMS: a 32 MiB body of them held the
    event loop for seconds. Past it such a list is refused, naming the field."""
    from lowproxy.handshakes.request_models import refused_field
    from lowproxy.lax_types import MAX_LAX_ITEMS
    chat_body = {"messages": [{"role": "user", "content": "hi"}]}
    assert refused_field({**chat_body, "stop_token_ids": list(range(10 * MAX_LAX_ITEMS))},
                         "chat") is None
    assert refused_field({**chat_body, "stop_token_ids": ["5"] * MAX_LAX_ITEMS},
                         "chat") is None
    refused = refused_field({**chat_body, "stop_token_ids": ["5"] * (MAX_LAX_ITEMS + 1)},
                            "chat")
    assert refused is not None and refused[0] == "stop_token_ids"
