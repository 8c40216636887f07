"""The demo backend itself, driven over sockets: it must do what vLLM 0.33 (and
SGLang) do on the points the proxy relies on, or the proxy's tests prove nothing.

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
from lowproxy.demo.kv import EOS_TOKEN_ID, OUTPUT_TOKEN_BASE, render_messages, tokenize

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


async def test_a_streamed_mooncake_decode_whose_kv_never_comes_fails_in_its_stream():
    """vLLM 0.30+ (PROTOCOL.md): non-streaming 500; streaming, 200 then an error event
    and [DONE]. The demo answered a streamed request 500 as well."""
    async with pair(kv_wait_timeout=0.3) as (prefill, decode):
        prefill.eos_first = 1.0  # the prefill stops: Mooncake frees its KV
        _, second = await mooncake_legs(prefill, decode, chat_body(max_tokens=1),
                                        chat_body(stream=True))
        assert second.status == 200
        assert second.header("content-type").startswith(b"text/event-stream")
        events = [line for line in second.body.split(b"\n\n") if line]
        assert json.loads(events[0].removeprefix(b"data: "))["error"]["message"] == \
            "KV transfer timed out"
        assert events[-1] == b"data: [DONE]"


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


# -- SGLang: the decode waits for its room; /abort_request ends a request at once


def sglang_body(room, rid, **extra):
    return chat_body(bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=room,
                     rid=rid, **extra)


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_decode_waits_for_its_room_and_abort_frees_it(stream):
    async with pair(kv_wait_timeout=None) as (prefill, decode):
        waiting = asyncio.ensure_future(request(decode.port, "POST", CHAT,
                                                sglang_body(7, "lowproxy-0001-a", stream=stream)))
        await wait_until(lambda: decode._inflight, what="decode waiting")
        assert not waiting.done()
        # SGLang 0.5.23 (one tokenizer worker) aborts the exact rid, not a prefix.
        prefix = await request(decode.port, "POST", "/abort_request", {"rid": "lowproxy-0001"})
        assert prefix.status == 200 and decode.aborted == [] and not waiting.done()
        abort = await request(decode.port, "POST", "/abort_request",
                              {"rid": "lowproxy-0001-a"})
        assert abort.status == 200 and abort.body == b""
        reply = await asyncio.wait_for(waiting, 2)
        assert reply.status == 200
        assert b'"finish_reason":{"type":"abort"' in reply.body
        assert decode.abort_requests == ["lowproxy-0001", "lowproxy-0001-a"]
        assert decode.aborted == ["lowproxy-0001-a"]  # matched exactly


async def test_sglang_abort_of_another_rid_leaves_the_request_waiting():
    async with pair(kv_wait_timeout=None) as (prefill, decode):
        waiting = asyncio.ensure_future(request(decode.port, "POST", CHAT,
                                                sglang_body(8, "lowproxy-0002")))
        await wait_until(lambda: decode._inflight, what="decode waiting")
        await request(decode.port, "POST", "/abort_request", {"rid": "lowproxy-0003"})
        assert decode.aborted == [] and not waiting.done()
        reply = await request(prefill.port, "POST", CHAT, sglang_body(8, "lowproxy-0002",
                                                                      max_tokens=1))
        assert reply.status == 200
        answer = (await asyncio.wait_for(waiting, 2)).json()
        assert answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "


async def test_sglang_prefill_honours_abort_too():
    async with pair() as (prefill, decode):
        prefill.faults.hang = True
        held = asyncio.ensure_future(request(prefill.port, "POST", CHAT,
                                             sglang_body(9, "lowproxy-0004")))
        await wait_until(lambda: prefill._inflight, what="prefill running")
        await request(prefill.port, "POST", "/abort_request", {"rid": "lowproxy-0004"})
        reply = await asyncio.wait_for(held, 2)
        assert reply.json()["choices"][0]["finish_reason"]["type"] == "abort"
        assert prefill.aborted == ["lowproxy-0004"]


# -- POST /v1/responses


async def test_responses_object_with_handshake_and_store():
    async with pair() as (prefill, decode):
        body = {"model": "demo-model", "input": "hello there", "max_output_tokens": 3}
        first, second = await mooncake_legs(prefill, decode,
                                            {**body, "max_output_tokens": 1, "store": False},
                                            body, path=RESPONSES)
        assert prefill.stored_responses == {}  # store false on the prefill leg
        answer = second.json()
        assert second.header("content-type") == b"application/json"
        assert answer["object"] == "response" and answer["id"].startswith("resp_")
        assert answer["status"] == "incomplete"
        assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
        [item] = answer["output"]
        assert item["type"] == "message" and item["role"] == "assistant"
        assert item["content"][0]["type"] == "output_text"
        assert item["content"][0]["text"] == "tok0 tok1 tok2 "
        # A Mooncake decode after a pull reports the pulled prompt as cached.
        assert answer["usage"] == {"input_tokens": 3, "input_tokens_details": {
            "cached_tokens": 3}, "output_tokens": 3, "output_tokens_details": {
            "reasoning_tokens": 0}, "total_tokens": 6}
        assert answer["kv_transfer_params"] is None and "kv_transfer_params" in answer
        assert list(decode.stored_responses) == [answer["id"]]  # store defaults to true
        kept = await request(decode.port, "GET", f"/v1/responses/{answer['id']}")
        assert kept.json()["output"] == answer["output"]


async def test_responses_stream_events():
    async with single() as decode:
        reply = await request(decode.port, "POST", RESPONSES,
                              {"input": [{"role": "user", "content": "hi"}], "stream": True})
        assert reply.header("content-type") == b"text/event-stream; charset=utf-8"
        assert b"[DONE]" not in reply.body
        events = parse_events(reply.body)
        kinds = [kind for kind, _ in events]
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         *["response.output_text.delta"] * 17, "response.output_text.done",
                         "response.content_part.done", "response.output_item.done",
                         "response.completed"]
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        assert all(data["type"] == kind for kind, data in events)
        done = events[-1][1]["response"]
        assert done["status"] == "completed"  # no cap: the demo model ends with EOS
        assert done["usage"]["output_tokens"] == 17 and events[0][1]["response"]["usage"] is None
        assert done["usage"]["input_tokens_details"] == {"cached_tokens": 0}


async def test_responses_previous_response_unknown_here_is_404():
    async with single() as decode:
        reply = await request(decode.port, "POST", RESPONSES,
                              {"input": "x", "previous_response_id": "resp_elsewhere"})
        assert reply.status == 404 and error_of(reply)["param"] == "previous_response_id"


def parse_events(raw):
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            events.append((kind[7:], json.loads(data[6:])))
    return events


# -- POST /v1/messages (Anthropic)


async def test_messages_object_drops_ignore_eos_and_reports_cache_reads():
    async with pair(prompt_tokens_details=True, kv_wait_timeout=0.3) as (prefill, decode):
        body = {"model": "demo-model", "messages": HELLO, "max_tokens": 4,
                "stop_sequences": ["tok2"]}
        prefill.eos_first = 1.0
        first, second = await mooncake_legs(prefill, decode,
                                            {**body, "max_tokens": 1, "ignore_eos": True,
                                             "stop_sequences": []}, body, path=MESSAGES)
        # ignore_eos is not a Messages field: the EOS first token stops the prefill.
        assert first.json()["stop_reason"] == "end_turn"
        assert prefill.kv_dropped == ["xfer-1"]
        assert second.status == 500  # the decode never gets its KV

        decode_only = await request(decode.port, "POST", MESSAGES, body)
        answer = decode_only.json()
        assert answer["type"] == "message" and answer["role"] == "assistant"
        assert answer["content"] == [{"type": "text", "text": "tok0 tok1 "}]
        assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", "tok2")
        assert answer["usage"] == {"input_tokens": 3, "output_tokens": 3,
                                   "cache_read_input_tokens": 0,
                                   "cache_creation_input_tokens": 0}


async def test_messages_stream_events_and_usage():
    async with single(prompt_tokens_details=True, block_size=1) as decode:
        body = {"messages": HELLO, "max_tokens": 2, "stream": True}
        await request(decode.port, "POST", MESSAGES, {**body, "stream": False})  # warm
        reply = await request(decode.port, "POST", MESSAGES, body)
        events = parse_events(reply.body)
        assert [kind for kind, _ in events] == [
            "message_start", "content_block_start", "content_block_delta",
            "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
        start = events[0][1]["message"]
        # Cached: whole blocks, never the prompt's last token (3 tokens -> 2).
        assert start["usage"] == {"input_tokens": 1, "output_tokens": 0,
                                  "cache_read_input_tokens": 2,
                                  "cache_creation_input_tokens": 0}
        assert events[2][1]["delta"] == {"type": "text_delta", "text": "tok0 "}
        assert events[5][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert events[5][1]["usage"]["output_tokens"] == 2


async def test_messages_without_max_tokens_is_400_in_anthropic_shape():
    async with single() as decode:
        reply = await request(decode.port, "POST", MESSAGES, {"messages": HELLO})
        assert reply.status == 400
        assert reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] == "invalid_request_error"


async def test_messages_without_messages_is_400_as_vllm_answers():
    async with single() as decode:
        for body in ({"max_tokens": 4}, {"max_tokens": 4, "messages": "hello"}):
            reply = await request(decode.port, "POST", MESSAGES, body)
            assert reply.status == 400 and reply.json()["type"] == "error"
            assert "messages" in reply.json()["error"]["message"]


# -- POST /inference/v1/generate (token in, token out)


async def test_generate_needs_scale_out():
    async with single() as decode:
        reply = await request(decode.port, "POST", GENERATE,
                              {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}})
        assert reply.status == 403


async def test_generate_reads_sampling_params_only():
    async with pair(scale_out=True) as (prefill, decode):
        assert (await request(decode.port, "POST", GENERATE, {"token_ids": [5, 6]})).status == 400
        body = {"token_ids": [5, 6, 7], "max_tokens": 9, "ignore_eos": True,
                "sampling_params": {"max_tokens": 2}}
        first, second = await mooncake_legs(
            prefill, decode, {**body, "sampling_params": {"max_tokens": 1}}, body, path=GENERATE)
        assert first.json()["choices"][0]["token_ids"] == [OUTPUT_TOKEN_BASE]
        answer = second.json()
        assert answer["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length",
                                      "token_ids": [OUTPUT_TOKEN_BASE, OUTPUT_TOKEN_BASE + 1]}]
        assert "kv_transfer_params" in answer and decode.kv_pulls[0]["prompt_tokens"] == 3
        # Top-level ignore_eos is not read: an EOS first token stops it.
        decode.eos_first = 1.0
        eos = await request(decode.port, "POST", GENERATE, body)
        assert eos.json()["choices"][0]["token_ids"] == [EOS_TOKEN_ID]
        inside = {**body, "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
        assert len((await request(decode.port, "POST", GENERATE, inside)).json()[
            "choices"][0]["token_ids"]) == 2


async def test_generate_stream_accepts_stream_options_alone():
    async with single(scale_out=True) as decode:
        body = {"token_ids": [5], "sampling_params": {"max_tokens": 2},
                "stream_options": {"include_usage": True}}
        assert (await request(decode.port, "POST", GENERATE, body)).status == 200
        reply = await request(decode.port, "POST", GENERATE, {**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in reply.body.decode().split("\n\n")
                  if line.startswith("data: {")]
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[OUTPUT_TOKEN_BASE],
                                                                  [OUTPUT_TOKEN_BASE + 1]]
        assert reply.body.endswith(b"data: [DONE]\n\n")


# -- cached tokens, return_token_ids, prompt_token_ids


async def test_prompt_tokens_details_only_with_the_knob():
    async with single() as plain, single(prompt_tokens_details=True, block_size=1) as detailed:
        assert (await request(plain.port, "POST", CHAT, chat_body())).json()[
            "usage"]["prompt_tokens_details"] is None
        first = (await request(detailed.port, "POST", CHAT, chat_body())).json()["usage"]
        again = (await request(detailed.port, "POST", CHAT, chat_body())).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["prompt_tokens_details"] == {"cached_tokens": HELLO_TOKENS - 1}


async def test_prefix_cache_is_bounded_and_per_backend():
    async with pair(prompt_tokens_details=True, block_size=1,
                    prefix_cache_blocks=3) as (prefill, decode):
        long = [{"role": "user", "content": "a b c d e f g"}]
        await request(prefill.port, "POST", CHAT, chat_body(messages=long))
        assert len(prefill.prefix_cache) == 3 and len(decode.prefix_cache) == 0
        other = await request(decode.port, "POST", CHAT, chat_body(messages=long))
        assert other.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_nixl_decode_reports_the_prefill_cached_figure():
    async with pair(prompt_tokens_details=True, block_size=1) as (prefill, decode):
        await request(prefill.port, "POST", CHAT, chat_body())  # warm the prefill only
        first, second = await relay_legs(prefill, decode, chat_body(max_tokens=1), chat_body())
        assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
        assert first.json()["kv_transfer_params"]["remote_prefill_cached_tokens"] == 2
        assert second.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


async def test_return_token_ids_and_tokenize_once():
    async with pair() as (prefill, decode):
        first = await request(prefill.port, "POST", CHAT,
                              chat_body(max_tokens=1, return_token_ids=True))
        ids = first.json()["prompt_token_ids"]
        assert ids == tokenize(render_messages(HELLO))
        assert first.json()["choices"][0]["token_ids"] == [OUTPUT_TOKEN_BASE]
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [],
              "remote_request_id": "r", "prompt_token_ids": [7, 8, 9, 10]}
        reply = await request(decode.port, "POST", CHAT, chat_body(kv_transfer_params=kv))
        assert decode.tokenization_skipped == 1
        assert reply.json()["usage"]["prompt_tokens"] == 4  # the ids given, not re-tokenized


# -- --api-key, /v1/models, /health


async def test_api_key_guards_the_v1_routes():
    async with single(api_key="sekret") as decode:
        for method, path, body in (("GET", "/v1/models", None), ("POST", CHAT, chat_body())):
            reply = await request(decode.port, method, path, body)
            assert reply.status == 401 and reply.json() == {"error": "Unauthorized"}
            wrong = await request(decode.port, method, path, body,
                                  headers=[("authorization", "Bearer nope")])
            assert wrong.status == 401
            good = await request(decode.port, method, path, body,
                                 headers=[("authorization", "Bearer sekret")])
            assert good.status == 200
        assert (await request(decode.port, "GET", "/health")).status == 200


async def test_models_list_names_and_length_and_unknown_model_is_404():
    async with single(served_model_names=["alpha", "beta"], max_model_len=2048) as decode:
        models = (await request(decode.port, "GET", "/v1/models")).json()["data"]
        assert [(m["id"], m["max_model_len"], m["root"]) for m in models] == [
            ("alpha", 2048, "alpha"), ("beta", 2048, "alpha")]
        assert (await request(decode.port, "POST", CHAT, chat_body(model="beta"))).status == 200
        reply = await request(decode.port, "POST", CHAT, chat_body(model="gamma"))
        assert reply.status == 404
        assert reply.json() == {"error": {"message": "The model `gamma` does not exist.",
                                          "type": "NotFoundError", "param": "model",
                                          "code": 404}}
    async with single() as lenient:  # the default answers any model name
        assert (await request(lenient.port, "POST", CHAT, chat_body(model="m"))).status == 200


# -- python -m lowproxy.demo


def test_cli_help_describes_every_option():
    out = subprocess.run([sys.executable, "-m", "lowproxy.demo", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    for option in ("--role", "--port", "--bootstrap-port", "--api-key", "--served-model-name",
                   "--max-model-len", "--enable-prompt-tokens-details", "--enable-scale-out",
                   "--relay-connector", "--eos-first", "--kv-wait-timeout", "--stream-chunks"):
        assert option in out
    from lowproxy.demo.__main__ import parser

    assert all(action.help for action in parser()._actions)  # each option says what it does


def _spawn(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "lowproxy.demo", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, json.loads(proc.stdout.readline())


async def test_cli_separate_processes_transfer_the_kv():
    from helpers import free_port

    bootstrap = free_port()
    prefill, pinfo = _spawn("--role", "prefill", "--port", "0", "--bootstrap-port",
                            str(bootstrap), "--kv-wait-timeout", "5")
    decode, dinfo = _spawn("--role", "decode", "--port", "0", "--kv-wait-timeout", "5")
    try:
        assert pinfo["bootstrap_port"] == bootstrap
        p_port, d_port = (int(info[role].rsplit(":", 1)[1])
                          for info, role in ((pinfo, "prefill"), (dinfo, "decode")))
        query = await request_bootstrap(bootstrap)
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-cli",
              "remote_engine_id": query["0"]["engine_id"],
              "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}"}
        pending = asyncio.ensure_future(request(d_port, "POST", CHAT,
                                                chat_body(kv_transfer_params=kv)))
        first = await request(p_port, "POST", CHAT, chat_body(
            max_tokens=1, kv_transfer_params={**PREFILL_KV, "transfer_id": "xfer-cli"}))
        assert first.status == 200 and (await pending).status == 200
        # NIXL, relayed: the decode reads the KV through the prefill's side channel.
        nixl = await request(p_port, "POST", CHAT, chat_body(max_tokens=1,
                                                            kv_transfer_params=PREFILL_KV))
        params = {**nixl.json()["kv_transfer_params"], "do_remote_prefill": True,
                  "do_remote_decode": False}
        assert params["remote_port"] == bootstrap
        assert (await request(d_port, "POST", CHAT, chat_body(kv_transfer_params=params))
                ).status == 200
    finally:
        for proc in (prefill, decode):
            proc.terminate()
            proc.wait(10)
            proc.stdout.close()
            proc.stderr.close()


async def request_bootstrap(port):
    return (await request(port, "GET", "/query")).json()


# -- the engine's load: /metrics, ORCA reports, the generated tokens cached


def gauges(text: str) -> dict[str, float]:
    return {line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("vllm:")}


async def test_metrics_and_orca_report_the_engine_load():
    async with single(prompt_tokens_details=True, block_size=1) as decode:
        plain = await request(decode.port, "POST", CHAT, chat_body())
        assert plain.header("endpoint-load-metrics") is None  # not asked
        asked = await request(decode.port, "POST", CHAT, chat_body(),
                              headers=[("endpoint-load-metrics-format", "TEXT")])
        raw = asked.header("endpoint-load-metrics")
        assert raw is not None
        report = raw.decode()
        assert report.startswith("TEXT ")
        assert "named_metrics.num_requests_waiting=0" in report
        assert "named_metrics.kv_cache_usage_perc=" in report
        streamed = await request(decode.port, "POST", CHAT, chat_body(stream=True),
                                 headers=[("endpoint-load-metrics-format", "TEXT")])
        assert streamed.header("endpoint-load-metrics") is None  # streams carry none
        seen = gauges((await request(decode.port, "GET", "/metrics")).body.decode())
        assert seen["vllm:num_requests_waiting"] == 0 and seen["vllm:num_requests_running"] == 0
        assert seen["vllm:prefix_cache_queries_total"] == 3 * HELLO_TOKENS
        assert seen["vllm:prefix_cache_hits_total"] == 2 * (HELLO_TOKENS - 1)
        # vLLM 0.33 reports on chat and completions answers only.
        ask = [("endpoint-load-metrics-format", "TEXT")]
        for path, body in (("/v1/responses", {"model": "demo-model", "input": "hi",
                                              "max_output_tokens": 2}),
                           ("/v1/messages", {"model": "demo-model", "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hi"}]})):
            other = await request(decode.port, "POST", path, body, headers=ask)
            assert other.status == 200 and other.header("endpoint-load-metrics") is None
        assert "vllm:kv_cache_usage_perc" in seen


async def test_a_request_waiting_for_compute_is_counted_waiting():
    async with single(prefill_us_per_token=200_000.0) as decode:  # 0.2 s per token
        slow = asyncio.ensure_future(request(decode.port, "POST", CHAT, chat_body()))
        queued = asyncio.ensure_future(request(decode.port, "POST", CHAT, chat_body()))
        await wait_until(lambda: decode.load.waiting == 1)
        assert decode.load.running == 1
        slow.cancel()
        queued.cancel()
        await asyncio.gather(slow, queued, return_exceptions=True)


async def test_the_next_turn_hits_the_answer_the_decode_generated():
    async with single(prompt_tokens_details=True, block_size=1) as decode:
        first = (await request(decode.port, "POST", CHAT, chat_body())).json()
        answer = first["choices"][0]["message"]["content"]
        turns = HELLO + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "and then"}]
        second = (await request(decode.port, "POST", CHAT, chat_body(messages=turns))).json()
        # Everything up to the new user turn was cached: the prompt and the answer.
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            second["usage"]["prompt_tokens"] - 3


async def test_beam_search_drops_the_kv_transfer_params():
    """vLLM 0.33's beam search drops kv_transfer_params entirely: a decode leg asking
    for KV computes the prompt itself (no pull), a prefill leg hands nothing off."""
    async with pair() as (prefill, decode):
        first = await request(prefill.port, "POST", CHAT, {
            **chat_body(max_tokens=1), "use_beam_search": "true",
            "kv_transfer_params": PREFILL_KV})
        assert first.status == 200 and first.json().get("kv_transfer_params") is None
        second = await request(decode.port, "POST", CHAT, {
            **chat_body(), "use_beam_search": True,
            "kv_transfer_params": mooncake_kv(prefill, "xfer-9")})
        assert second.status == 200 and decode.kv_pulls == []
