"""Issue 19, pure: under sglang every generation request is planned with both legs.

An SGLang decode in disaggregation mode refuses every request without a
bootstrap room, so none of vLLM's decode-only rules applies, and a batch
(several prompts, token-id lists, n > 1) carries one room per child SGLang
makes, with the child rids (``<rid>_<i>``) to abort.
"""

from __future__ import annotations

import itertools
import json

import pytest

from helpers import chat, config_for
from lowproxy.handshakes import sglang
from lowproxy.handshakes.planner import skip_reason
from lowproxy.routes import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    GENERATION,
    MESSAGES,
    PASSTHROUGH,
    RESPONSES,
    SGLANG_GENERATE,
    classify,
    surface_of,
)

RID = "lowproxy-" + "0" * 32


def counter(start: int = 100):
    numbers = itertools.count(start)
    return lambda: next(numbers)


@pytest.mark.parametrize("surface, body, expected", [
    (CHAT, chat(), None),
    (CHAT, chat(n=1), None),
    (CHAT, chat(n=3), 3),
    (CHAT, chat(n=True), None),  # not an int to SGLang's pydantic either
    (COMPLETIONS, {"prompt": "one"}, None),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, None),  # one prompt, in token ids
    (COMPLETIONS, {"prompt": ["a", "b"]}, 2),
    (COMPLETIONS, {"prompt": ["only"]}, 1),  # a list is a batch, even of one
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, 2),
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}, 6),
    (COMPLETIONS, {"prompt": "one", "echo": True, "n": 2}, 2),
    (RESPONSES, {"input": "hi", "n": 4}, None),  # one completion
    (MESSAGES, {"messages": [], "max_tokens": 4, "n": 4}, None),
    (SGLANG_GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": 4}}, None),
    (SGLANG_GENERATE, {"text": ["a", "b"]}, 2),
    (SGLANG_GENERATE, {"input_ids": [1, 2]}, None),
    (SGLANG_GENERATE, {"input_ids": [[1, 2], [3, 4], [5]]}, 3),
    (SGLANG_GENERATE, {"text": "hi", "sampling_params": {"n": 3}}, 3),
    (SGLANG_GENERATE, {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, 4),
])
def test_how_many_children_sglang_makes(surface, body, expected):
    assert sglang.children(surface, body) == expected


def legs_of(surface, body, new_room=None):
    plan = sglang.plan(body, b"/v1/x?q=1", b"/v1/x", object(), "10.0.0.5", 8998,
                       new_room or counter(), RID, surface)
    return plan, json.loads(plan.prefill_body), json.loads(plan.decode_body)


def test_a_single_request_gets_one_room_and_its_own_rid():
    plan, prefill, decode = legs_of(CHAT, chat())
    assert prefill == decode and prefill["bootstrap_room"] == 100
    assert prefill["rid"] == RID and plan.abort_rids == (RID,)
    assert plan.concurrent and plan.prefill_target == b"/v1/x"


@pytest.mark.parametrize("surface, body, count", [
    (COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": 3}, 2),
    (COMPLETIONS, {"prompt": [[1], [2], [3]]}, 3),
    (CHAT, chat(n=2), 2),
    (COMPLETIONS, {"prompt": ["a", "b"], "n": 2}, 4),
    (SGLANG_GENERATE, {"text": ["a", "b"], "sampling_params": {"n": 3}}, 6),
])
def test_a_batch_gets_one_room_per_child_on_both_legs(surface, body, count):
    plan, prefill, decode = legs_of(surface, body)
    assert prefill == decode
    rooms = prefill["bootstrap_room"]
    assert isinstance(rooms, list) and len(rooms) == count == len(set(rooms))
    assert prefill["rid"] == RID  # SGLang names the children from it
    assert plan.abort_rids == tuple(f"{RID}_{i}" for i in range(count))
    # Nothing of the client's body is capped or dropped.
    assert {k: v for k, v in prefill.items()
            if k not in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")} == body


def test_rooms_of_a_batch_are_distinct_even_when_a_draw_repeats():
    draws = iter([7, 7, 7, 8, 7, 9])
    _, prefill, _ = legs_of(COMPLETIONS, {"prompt": ["a", "b", "c"]}, lambda: next(draws))
    assert sorted(prefill["bootstrap_room"]) == [7, 8, 9]


@pytest.mark.parametrize("surface, body", [
    (COMPLETIONS, {"prompt": ["a", "b"]}),
    (COMPLETIONS, {"prompt": "x", "echo": True}),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1}),
    (CHAT, chat(use_beam_search=True)),
    (RESPONSES, {"input": "x", "background": True}),
    (RESPONSES, {"input": "x", "previous_response_id": "resp_1"}),
    (GENERATE, {"token_ids": [1]}),  # no sampling_params
    (CHAT, chat()),  # short, with a minimum prompt size set
])
def test_no_decode_only_rule_applies_under_sglang(surface, body):
    sglang_config = config_for(kv_protocol="sglang", min_prefill_prompt_bytes=10_000)
    vllm_config = config_for(kv_protocol="mooncake", min_prefill_prompt_bytes=10_000)
    assert skip_reason(sglang_config, surface, body, 5) is None
    assert skip_reason(vllm_config, surface, body, 5) is not None  # the vLLM rules hold


def test_native_generate_is_a_generation_surface_under_sglang_only():
    assert surface_of("/generate", sglang=True) == SGLANG_GENERATE
    assert classify(b"POST", "/generate", sglang=True) == GENERATION
    assert surface_of("/generate") is None
    assert classify(b"POST", "/generate") == PASSTHROUGH
    for flag in (False, True):  # vLLM's own generate API keeps its surface
        assert surface_of("/inference/v1/generate", sglang=flag) == GENERATE
    assert classify(b"GET", "/generate", sglang=True) == PASSTHROUGH
