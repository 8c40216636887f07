"""Issue 12: the legs follow vLLM 0.33's rules, so every transferred KV is used.

Pure planning rules on dicts first, then end to end against the strict demo
backend (it drops a Mooncake KV when prefill stops, counts KV copies, pulls
prompt 0 only, rejects what vLLM's request models reject).
"""

from __future__ import annotations

import pytest

from helpers import CHAT, chat, pd_setup
from lowproxy.handshakes import relay
from lowproxy.handshakes.legs import (
    mooncake_bodies,
    primed_prefill_body,
    relay_decode_body,
    relay_prefill_body,
)
from lowproxy.handshakes.rules import PREFILL_DROPPED, cannot_hand_off, decode_would_reject
from lowproxy.proxy.failures import prefill_outcome
from lowproxy.routes import surface_of

COMPLETIONS = "/v1/completions"

# -- pure: the prefill leg carries only what computes the prompt


def test_prefill_leg_drops_what_would_stop_or_be_wasted_and_asks_one_copy():
    client = chat(stop=["\n"], stop_token_ids=[2, 128001], logprobs=True, top_logprobs=5,
                  n=3, tools=[{"type": "function", "function": {"name": "f"}}],
                  tool_choice="auto", chat_template_kwargs={"enable_thinking": False},
                  reasoning_effort="low", documents=[{"text": "d"}], seed=7)
    prefill = relay_prefill_body(client)
    for field in ("stop", "stop_token_ids", "logprobs", "top_logprobs"):
        assert field not in prefill, field
    assert prefill["n"] == 1 and prefill["max_tokens"] == 1 and prefill["ignore_eos"] is True
    for kept in ("messages", "tools", "tool_choice", "chat_template_kwargs",
                 "reasoning_effort", "documents", "seed", "model"):
        assert prefill[kept] == client[kept], kept
    # Decode keeps the client's n and stop rules.
    decode = relay_decode_body(client, {"remote_block_ids": [[1]], "remote_engine_id": "e"})
    assert decode["n"] == 3 and decode["stop"] == ["\n"] and decode["logprobs"] is True


def test_prefill_leg_without_n_gets_none_and_the_table_names_every_dropped_field():
    assert "n" not in primed_prefill_body(chat(), None)
    assert set(PREFILL_DROPPED) >= {"stream_options", "min_tokens", "min_completion_tokens",
                                    "stop_token_ids", "stop", "logprobs", "top_logprobs",
                                    "logprob_token_ids"}
    prefill, _ = mooncake_bodies(chat(stop="x", n=2), "xfer-1", "eng", "http://p:8998")
    assert "stop" not in prefill and prefill["n"] == 1


@pytest.mark.parametrize("path, body, reason", [
    (COMPLETIONS, {"prompt": ["a", "b"]}, "list-prompts"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, "list-prompts"),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, None),  # one prompt, in token ids
    (COMPLETIONS, {"prompt": ["only one"]}, None),
    (COMPLETIONS, {"prompt": "a"}, None),
    (CHAT, {"messages": [], "use_beam_search": True}, "beam-search"),
    (COMPLETIONS, {"prompt": "a", "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "a", "prompt_logprobs": 0}, "prompt-logprobs"),
    (CHAT, {"messages": [], "echo": False, "prompt_logprobs": None}, None),
    ("/inference/ep/v1/completions", {"prompt": ["a", "b"]}, "list-prompts"),
])
def test_requests_that_cannot_be_handed_off(path, body, reason):
    assert cannot_hand_off(surface_of(path) or "", body) == reason


@pytest.mark.parametrize("body, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 40, "max_completion_tokens": 4}, "min_tokens"),
    # vLLM's own tests: a truthy stream_options, a prompt_logprobs above 0 or -1.
    ({"stream_options": {"include_usage": False}}, "stream_options"),
    ({"prompt_logprobs": -1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 0.5, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": True, "stream": 1}, "prompt_logprobs"),
])
def test_what_decode_rejects_is_named(body, param):
    found = decode_would_reject(body)
    assert found is not None and found[0] == param


@pytest.mark.parametrize("body", [
    {"stream_options": {"include_usage": True}, "stream": True},
    {"prompt_logprobs": 1},
    {"min_tokens": 4, "max_tokens": 4},
    {"min_tokens": 9, "max_tokens": 4, "max_completion_tokens": 10},
    {"min_tokens": True, "max_tokens": 0},
    # vLLM tests truthiness (validate_stream_options) and prompt_logprobs > 0 or
    # == -1 (check_logprobs): these it serves.
    {"stream_options": {}},
    {"stream_options": {}, "stream": False},
    {"stream_options": None},
    {"prompt_logprobs": 0, "stream": True},
    {"prompt_logprobs": 0.0, "stream": True},
    {"prompt_logprobs": False, "stream": True},
    {"prompt_logprobs": 3, "stream": False},
])
def test_what_decode_accepts_passes(body):
    assert decode_would_reject(body) is None


# -- pure: prefill's parameters reach decode verbatim, whatever their shape

NIXL_033 = {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_block_ids": [[0, 1, 2], [7]], "remote_engine_id": "eng-0",
            "remote_request_id": "cmpl-1", "remote_host": "10.0.0.5", "remote_port": 5600,
            "tp_size": 2, "remote_registration_generation": 3,
            "remote_prefill_cached_tokens": 16, "pp_size": 1, "dcp_size": 1,
            "remote_num_tokens": 40, "remote_blocks_expiry_time": 1800000000.5,
            "transfer_mode": "pull"}
MOONCAKE_013 = {"do_remote_decode": True, "do_remote_prefill": False,
                "remote_host": "10.0.0.6", "remote_port": 17000}


@pytest.mark.parametrize("answer", [NIXL_033, MOONCAKE_013,
                                    dict(NIXL_033, remote_block_ids=[]),
                                    dict(NIXL_033, remote_block_ids=[[]])])
def test_relay_passes_every_key_on_with_the_flags_turned(answer):
    decode = relay_decode_body(chat(), answer)["kv_transfer_params"]
    assert decode == dict(answer, do_remote_prefill=True, do_remote_decode=False)


@pytest.mark.parametrize("answer", [None, [], "x", 3, {}])
def test_relay_params_that_are_not_an_object_mean_recompute(answer):
    assert "kv_transfer_params" not in relay_decode_body(chat(), answer)
    plan = relay.plan(chat(), CHAT.encode(), CHAT.encode(), object())
    assert plan.decode_body_for is not None
    assert b"kv_transfer_params" not in plan.decode_body_for(answer)


@pytest.mark.parametrize("status, outcome", [(400, "rejected"), (413, "rejected"),
                                             (422, "rejected"), (401, "error"),
                                             (404, "error"), (500, "error")])
def test_prefill_status_decides_refusal_or_failure_policy(status, outcome):
    result = prefill_outcome(status, b'{"error": {"message": "too long"}}', True)
    assert result.outcome == outcome and not result.ok
    if outcome == "rejected":
        assert result.body == b'{"error": {"message": "too long"}}'
    else:
        assert "misconfigured" in result.detail or status >= 500


# -- end to end against the strict demo backends


@pytest.mark.parametrize("extra", [{"stop_token_ids": [1000]}, {"stop": ["tok0"]}])
async def test_mooncake_stop_rules_never_reach_prefill_so_the_kv_is_kept(extra):
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        decode.kv_wait_timeout = 2.0
        reply = await proxy.request("POST", CHAT, chat(**extra))
        assert reply.status == 200, reply.body
        assert prefill.kv_dropped == []
        [pf], [dc] = prefill.requests_to(CHAT), decode.requests_to(CHAT)
        assert not set(extra) & set(pf.body)
        assert {k: dc.body[k] for k in extra} == extra  # decode keeps the client's rule


async def test_n_makes_one_kv_copy_and_decode_keeps_n():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(n=2))
        assert reply.status == 200, reply.body
        assert prefill.kv_copies == [1]
        [dc] = decode.requests_to(CHAT)
        assert dc.body["n"] == 2 and len(reply.json()["choices"]) == 2


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
@pytest.mark.parametrize("extra, reason", [
    ({"prompt": ["one", "two"]}, "list-prompts"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "use_beam_search": True}, "beam-search"),
    ({"prompt": "hi", "prompt_logprobs": 1}, "prompt-logprobs"),
])
async def test_requests_that_cannot_be_handed_off_go_to_decode_alone(kv_protocol, extra,
                                                                      reason):
    async with pd_setup(kv_protocol) as (proxy, prefill, decode):
        client = {"model": "demo-model", "max_tokens": 3, **extra}
        reply = await proxy.request("POST", COMPLETIONS, client)
        assert reply.status == 200, reply.body
        assert prefill.requests_to(COMPLETIONS) == []
        [dc] = decode.requests_to(COMPLETIONS)
        assert dc.body == client  # unchanged, no kv_transfer_params
        assert proxy.proxy.metrics.prefill_legs.get(kv_protocol, "skipped", reason) == 1
        page = (await proxy.request("GET", "/metrics")).body.decode()
        assert (f'lowproxy_prefill_legs_total{{handshake="{kv_protocol}",outcome="skipped",'
                f'reason="{reason}"}} 1') in page


@pytest.mark.parametrize("extra, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 9, "max_completion_tokens": 4, "max_tokens": 20}, "min_tokens"),
])
async def test_what_decode_rejects_is_400_before_either_leg(extra, param):
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        reply = await proxy.request("POST", CHAT, chat(**extra))
        assert reply.status == 400
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert error["code"] == 400 and error["message"]
        assert prefill.received == [] and decode.received == []
        assert prefill.bootstrap_queries == 0


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
@pytest.mark.parametrize("status", [400, 413, 422])
async def test_a_prefill_that_refuses_the_request_is_relayed(kv_protocol, status):
    async with pd_setup(kv_protocol) as (proxy, prefill, decode):
        prefill.faults.status = status
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == status
        assert "error" in reply.json()
        # Relay: decode never asked. Mooncake: the held decode leg is closed, and no
        # recompute leg follows.
        assert len(decode.requests_to(CHAT)) == (0 if kv_protocol == "relay" else 1)
        assert proxy.proxy.metrics.prefill_legs.get(kv_protocol, "rejected") == 1
        assert proxy.proxy.metrics.prefill_legs.get(kv_protocol, "recompute") == 0


async def test_a_misconfigured_prefill_keeps_the_failure_policy():
    async with pd_setup("relay") as (proxy, prefill, decode):
        prefill.faults.status = 401
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 200
        assert proxy.proxy.metrics.prefill_legs.get("relay", "recompute") == 1
    async with pd_setup("relay", on_prefill_failure="error") as (proxy, prefill, decode):
        prefill.faults.status = 403
        reply = await proxy.request("POST", CHAT, chat())
        assert reply.status == 502 and reply.json()["error"]["type"] == "prefill_failed"
        assert decode.received == []


def test_ids_are_unique_fixed_width_hex_and_differ_between_processes():
    from lowproxy.ids import Ids

    first, second = Ids(), Ids()
    made = [first.next_hex() for _ in range(1000)]
    assert len(set(made)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in made)
    assert first.next_hex()[:16] != second.next_hex()[:16]  # per-process random prefix


def test_transfer_ids_are_distinct_uuid4_shaped_and_differ_between_processes():
    import uuid

    from lowproxy.ids import Ids

    first, second = Ids(), Ids()
    made = [first.next_uuid() for _ in range(1000)]
    assert len(set(made)) == 1000
    for made_id in made:
        parsed = uuid.UUID(made_id)  # the llm-d sidecar's xfer-<uuid4> form
        assert str(parsed) == made_id
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert first.next_uuid()[:8] != second.next_uuid()[:8]  # per-process random prefix
