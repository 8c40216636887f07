"""The demo backend itself, driven over sockets: it must do what vLLM 0.33 (and
SGLang) do on the points PROTOCOL.md lists, or the proxy's tests prove nothing.

No proxy here: each test sends the legs by hand to a DemoBackend started in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, request, wait_until
from lowproxy.demo import DemoBackend, start_pair
from lowproxy.demo_kv import EOS_TOKEN_ID, OUTPUT_TOKEN_BASE, render_messages, tokenize

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RESPONSES, MESSAGES, GENERATE = "/v1/responses", "/v1/messages", "/inference/v1/generate"
HELLO = [{"role": "user", "content": "hello there"}]
HELLO_TOKENS = len(tokenize(render_messages(HELLO)))  # "user hello there": one per word


def chat_body(**extra):
    return {"model": "demo-model", "messages": HELLO, "max_tokens": 4, **extra}


@contextlib.asynccontextmanager
async def pair(**knobs):
    prefill, decode = await start_pair(**knobs)
    try:
        yield prefill, decode
    finally:
        await prefill.close()
        await decode.close()


@contextlib.asynccontextmanager
async def single(role="decode", **knobs):
    backend = await DemoBackend(role, **knobs).start(bootstrap_port=None)
    try:
        yield backend
    finally:
        await backend.close()


def mooncake_kv(prefill, transfer_id="xfer-1", **drop):
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
          "remote_engine_id": prefill.engine_ids["0"],
          "remote_bootstrap_addr": f"http://127.0.0.1:{prefill.bootstrap_port}"}
    return {k: v for k, v in kv.items() if k not in drop}


PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}


async def mooncake_legs(prefill, decode, prefill_body, decode_body, path=CHAT,
                        transfer_id="xfer-1"):
    """Both legs at once, as the concurrent handshake sends them."""
    decode_body = {**decode_body, "kv_transfer_params": mooncake_kv(prefill, transfer_id)}
    pending = asyncio.ensure_future(request(decode.port, "POST", path, decode_body))
    prefill_body = {**prefill_body, "kv_transfer_params": {**PREFILL_KV,
                                                           "transfer_id": transfer_id}}
    first = await request(prefill.port, "POST", path, prefill_body)
    return first, await pending


async def relay_legs(prefill, decode, prefill_body, decode_body, path=CHAT, headers=()):
    first = await request(prefill.port, "POST", path,
                          {**prefill_body, "kv_transfer_params": PREFILL_KV}, headers=headers)
    kv = first.json()["kv_transfer_params"]
    body = dict(decode_body)
    if isinstance(kv, dict):
        body["kv_transfer_params"] = {**kv, "do_remote_prefill": True, "do_remote_decode": False}
    return first, await request(decode.port, "POST", path, body, headers=headers)


def error_of(reply):
    return reply.json()["error"]


# -- Mooncake frees the KV of a prefill that finishes stopped; NIXL keeps it


@pytest.mark.parametrize("stopper", [
    {"stop_token_ids": [OUTPUT_TOKEN_BASE]},   # the one token is a listed stop id
    {"stop": ["tok0"]},                         # its text holds a stop string
    {"stop_token_ids": [EOS_TOKEN_ID], "ignore_eos": True, "eos": True},  # EOS listed
    {"eos": True},                              # EOS first, ignore_eos absent
])
async def test_mooncake_prefill_that_stops_drops_its_kv(stopper):
    stopper = dict(stopper)
    eos = stopper.pop("eos", False)
    async with pair(kv_wait_timeout=0.3) as (prefill, decode):
        prefill.eos_first = 1.0 if eos else 0.0
        first, second = await mooncake_legs(prefill, decode, chat_body(max_tokens=1, **stopper),
                                            chat_body())
        assert first.status == 200
        assert first.json()["choices"][0]["finish_reason"] == "stop"
        assert prefill.kv_dropped == ["xfer-1"]
        # vLLM 0.30+: the decode waits for KV that never comes, then fails the request.
        assert second.status == 500
        assert error_of(second)["message"] == "KV transfer timed out"


async def test_mooncake_prefill_capped_by_length_keeps_its_kv():
    async with pair(eos_first=1.0) as (prefill, decode):
        first, second = await mooncake_legs(prefill, decode,
                                            chat_body(max_tokens=1, ignore_eos=True), chat_body())
        assert first.json()["choices"][0]["finish_reason"] == "length"
        assert first.json()["kv_transfer_params"] is None  # nothing useful (0.16+)
        assert second.status == 200 and prefill.kv_dropped == []
        assert HELLO_TOKENS == 3
        assert decode.kv_pulls == [{"key": "xfer-1", "prompt_index": 0,
                                    "prompt_tokens": HELLO_TOKENS}]


async def test_nixl_prefill_that_stops_keeps_its_kv():
    async with pair() as (prefill, decode):
        first, second = await relay_legs(
            prefill, decode, chat_body(max_tokens=1, stop_token_ids=[OUTPUT_TOKEN_BASE]),
            chat_body())
        assert first.json()["choices"][0]["finish_reason"] == "stop"
        assert first.json()["choices"][0]["stop_reason"] == OUTPUT_TOKEN_BASE
        assert second.status == 200, second.body
        assert prefill.kv_dropped == [] and len(decode.kv_pulls) == 1


@pytest.mark.parametrize("n", [1, 3])
async def test_n_on_the_prefill_leg_makes_n_kv_copies(n):
    async with pair() as (prefill, decode):
        first, _ = await mooncake_legs(prefill, decode, chat_body(max_tokens=1, n=n), chat_body())
        assert prefill.kv_copies == [n]
        assert [c["index"] for c in first.json()["choices"]] == list(range(n))


async def test_list_prompts_pull_prompt_zero_only_and_share_the_params():
    async with pair() as (prefill, decode):
        prompts = ["first prompt", "second prompt here"]
        body = {"model": "demo-model", "prompt": prompts, "max_tokens": 2}
        first, second = await mooncake_legs(prefill, decode, {**body, "max_tokens": 1}, body,
                                            path=COMPLETIONS)
        assert second.status == 200, second.body
        assert [c["text"] for c in second.json()["choices"]] == ["tok0 tok1 "] * 2
        assert decode.kv_pulls == [{"key": "xfer-1", "prompt_index": 0, "prompt_tokens": 2}]
        assert decode.shared_kv_subrequests == 1
        assert prefill.kv_copies == [2]  # one engine request per prompt


# -- what decode rejects in its request model


@pytest.mark.parametrize("extra,param,message", [
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when stream=True."),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options",
     "Stream options can only be defined when stream=True."),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"min_tokens": 5}, "min_tokens",
     "min_tokens must be less than or equal to max_tokens=4, got 5."),
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_decode_rejects_what_vllm_rejects(extra, param, message, path):
    async with single() as decode:
        body = chat_body(**extra) if path == CHAT else {
            "model": "demo-model", "prompt": "hi", "max_tokens": 4, **extra}
        reply = await request(decode.port, "POST", path, body)
        assert reply.status == 400
        assert reply.json() == {"error": {"message": message, "type": "BadRequestError",
                                          "param": param, "code": 400}}


async def test_chat_min_tokens_against_max_completion_tokens():
    """In chat max_completion_tokens wins over max_tokens, for the check too."""
    async with single() as decode:
        reply = await request(decode.port, "POST", CHAT,
                              chat_body(min_tokens=3, max_completion_tokens=2, max_tokens=8))
        assert reply.status == 400 and error_of(reply)["message"] == \
            "min_tokens must be less than or equal to max_tokens=2, got 3."
        reply = await request(decode.port, "POST", CHAT,
                              chat_body(min_tokens=3, max_completion_tokens=3, max_tokens=2))
        assert reply.status == 200
        assert reply.json()["usage"]["completion_tokens"] == 3


async def test_max_tokens_over_the_context_is_400():
    async with single(max_model_len=10) as decode:
        reply = await request(decode.port, "POST", CHAT, chat_body(max_tokens=8))
        assert reply.status == 400 and error_of(reply)["param"] == "max_tokens"
        assert "maximum context length is 10 tokens" in error_of(reply)["message"]
        assert (await request(decode.port, "POST", CHAT, chat_body(max_tokens=6))).status == 200


# -- NIXL decode: block id shapes, pass-through keys, and the assertion that kills it


async def test_nixl_decode_without_block_ids_kills_the_engine_until_restarted():
    async with pair() as (prefill, decode):
        first = await request(prefill.port, "POST", CHAT,
                              chat_body(max_tokens=1, kv_transfer_params=PREFILL_KV))
        kv = {**first.json()["kv_transfer_params"], "do_remote_prefill": True,
              "do_remote_decode": False}
        del kv["remote_block_ids"]
        reply = await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv))
        assert reply.status == 500 and error_of(reply)["type"] == "EngineDeadError"
        assert (await request(decode.port, "GET", "/health")).status == 503
        again = await request(decode.port, "POST", CHAT, chat_body())
        assert again.status == 500 and error_of(again)["type"] == "EngineDeadError"
        decode.restart_engines()
        health = await request(decode.port, "GET", "/health")
        assert health.status == 200 and health.body == b""
        assert (await request(decode.port, "POST", CHAT, chat_body())).status == 200


async def test_engine_death_fails_the_requests_in_flight_too():
    async with pair() as (prefill, decode):
        decode.stream_chunks, decode.chunk_delay = 1000, 0.01
        streaming = asyncio.ensure_future(request(decode.port, "POST", CHAT,
                                                  chat_body(stream=True)))
        await wait_until(lambda: decode.open_streams == 1, what="stream running")
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "r"}
        await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv))
        cut = await streaming
        assert cut.status == 200 and not cut.complete


@pytest.mark.parametrize("blocks", [[], [[]]])
async def test_nixl_empty_block_ids_are_valid(blocks):
    async with single() as decode:
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": blocks,
              "remote_request_id": "r", "remote_engine_id": "e"}
        reply = await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv))
        assert reply.status == 200 and decode.dead is None


async def test_nixl_nested_block_ids_and_pass_through_keys():
    async with pair(nested_block_ids=True) as (prefill, decode):
        first = await request(prefill.port, "POST", CHAT,
                              chat_body(max_tokens=1, kv_transfer_params=PREFILL_KV))
        kv = first.json()["kv_transfer_params"]
        assert kv["remote_block_ids"] == [[1, 2, 3]]
        assert kv["remote_engine_id"] == prefill.engine_ids["0"]
        assert {"tp_size", "remote_registration_generation",
                "remote_prefill_cached_tokens"} <= set(kv)
        kv.update(do_remote_prefill=True, do_remote_decode=False, pp_size=1, dcp_size=1,
                  remote_num_tokens=4, remote_blocks_expiry_time=1e12, transfer_mode="read")
        reply = await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv))
        assert reply.status == 200, reply.body
        assert decode.kv_pulls[0]["key"] == kv["remote_request_id"]
        # The KV is read once: a second decode with the same params finds none.
        again = await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv))
        assert again.status == 500 and "no prefilled KV" in error_of(again)["message"]


# -- vLLM 0.13-0.15's Mooncake connector (relay-style, no block ids)


async def test_old_mooncake_connector_relay_params():
    async with pair(relay_connector="mooncake-0.13", kv_wait_timeout=0.3) as (prefill, decode):
        same = [("x-request-id", "req-7")]
        first, second = await relay_legs(prefill, decode, chat_body(max_tokens=1), chat_body(),
                                         headers=same)
        assert first.json()["kv_transfer_params"] == {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_host": "127.0.0.1", "remote_port": prefill.bootstrap_port}
        assert second.status == 200, second.body
        assert decode.kv_pulls[0]["key"] == "req-req-7"
        # A decode under another request id finds no KV for it.
        kv = {**first.json()["kv_transfer_params"], "do_remote_prefill": True}
        other = await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv),
                              headers=[("x-request-id", "req-8")])
        assert other.status == 500 and error_of(other)["message"] == "KV transfer timed out"


async def test_old_mooncake_connector_stopped_prefill_returns_no_params():
    async with pair(relay_connector="mooncake-0.13") as (prefill, decode):
        first = await request(prefill.port, "POST", CHAT,
                              chat_body(max_tokens=1, stop=["tok"],
                                        kv_transfer_params=PREFILL_KV),
                              headers=[("x-request-id", "req-9")])
        assert first.json()["kv_transfer_params"] is None
        assert prefill.kv_dropped == ["req-9"]


async def test_half_filled_mooncake_dict_waits_for_ever():
    async with pair(kv_wait_timeout=0.1) as (prefill, decode):
        kv = mooncake_kv(prefill, remote_engine_id=True)
        with pytest.raises(asyncio.TimeoutError):
            await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv),
                          timeout=0.5)
        assert decode.stuck_pulls == 1
