"""Issue 19, defects 2 and 3: a decode answer whose usage the proxy cannot rewrite.

Usage with a field of the wrong type (``prompt_tokens_details`` a string, Messages'
``cache_read_input_tokens`` not a number) or a number JSON cannot carry once Python
has read it (``1e400`` is infinity to Python; json.dumps would write the bare word
``Infinity``) is relayed byte for byte as decode sent it, streamed and not, on
chat/completions, completions, Responses and Messages. Over real sockets: a demo
prefill (it reports its cached-token figure, so the rewrite is on) and a scripted
decode that answers the hostile bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import Any, AsyncIterator

import pytest

from helpers import ScriptedBackend, config_for, running_proxy
from lowproxy.demo import DemoBackend
from lowproxy.handshakes.usage import rewrite_body, rewrite_events, rewrite_usage
from lowproxy.routes import CHAT, COMPLETIONS, MESSAGES, RESPONSES

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
RESPONSES_PATH, MESSAGES_PATH = "/v1/responses", "/v1/messages"
BODIES = {
    CHAT_PATH: {"model": "demo-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hello there"}]},
    COMPLETIONS_PATH: {"model": "demo-model", "max_tokens": 2, "prompt": "hello there"},
    RESPONSES_PATH: {"model": "demo-model", "input": "hello there", "max_output_tokens": 2},
    MESSAGES_PATH: {"model": "demo-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hello there"}]},
}

# Usage objects as raw JSON text (1e400 must stay text: Python cannot hold it).
OPENAI_HOSTILE = [
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":"cached"}',
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":7}',
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":[["cached_tokens",1]]}',
    '{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":true}',
    '{"prompt_tokens":"5","completion_tokens":2}',
    '{"prompt_tokens":1e400,"completion_tokens":2}',
    '{"prompt_tokens":5,"completion_tokens":2,"total_tokens":1e400}',  # rewritable but inf
    '{"prompt_tokens":5,"completion_tokens":2,"total_tokens":NaN}',
]
RESPONSES_HOSTILE = [
    '{"input_tokens":5,"output_tokens":2,"input_tokens_details":"cached"}',
    '{"input_tokens":5,"output_tokens":2,"input_tokens_details":3}',
    '{"input_tokens":5,"output_tokens":2,"input_tokens_details":["cached_tokens"]}',
    '{"input_tokens":1e400,"output_tokens":2}',
    '{"input_tokens":5,"output_tokens":2,"total_tokens":1e400}',
]
MESSAGES_HOSTILE = [
    '{"input_tokens":5,"output_tokens":2,"cache_read_input_tokens":"4"}',
    '{"input_tokens":5,"output_tokens":2,"cache_creation_input_tokens":"x"}',
    '{"input_tokens":5,"output_tokens":2,"cache_read_input_tokens":[1]}',
    '{"input_tokens":5,"output_tokens":2,"cache_creation_input_tokens":{"a":1}}',
    '{"input_tokens":5,"output_tokens":2,"cache_read_input_tokens":1.5}',
    '{"input_tokens":5,"output_tokens":2,"cache_read_input_tokens":-3}',
    '{"input_tokens":1e400,"output_tokens":2}',
    '{"input_tokens":5,"output_tokens":1e400,"cache_read_input_tokens":0}',  # inf elsewhere
]
CASES = ([(path, usage) for path in (CHAT_PATH, COMPLETIONS_PATH) for usage in OPENAI_HOSTILE]
         + [(RESPONSES_PATH, usage) for usage in RESPONSES_HOSTILE]
         + [(MESSAGES_PATH, usage) for usage in MESSAGES_HOSTILE])


def decode_answer(path: str, usage: str, stream: bool) -> bytes:
    """What a decode sends for ``path`` with ``usage`` in its usage-carrying parts."""
    if path in (CHAT_PATH, COMPLETIONS_PATH):
        if not stream:
            return ('{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,'
                    '"message":{"role":"assistant","content":"hi"}}],"usage":' + usage
                    + '}').encode()
        return ('data: {"id":"cmpl-1","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
                'data: {"id":"cmpl-1","choices":[],"usage":' + usage + '}\n\n'
                'data: [DONE]\n\n').encode()
    if path == RESPONSES_PATH:
        response = '{"id":"resp_1","object":"response","status":"completed","usage":' + usage
        if not stream:
            return (response + '}').encode()
        return ('event: response.created\ndata: {"type":"response.created","response":'
                '{"id":"resp_1","usage":null}}\n\n'
                'event: response.completed\ndata: {"type":"response.completed","response":'
                + response + '}}\n\n').encode()
    message = '{"id":"msg_1","type":"message","role":"assistant","usage":' + usage
    if not stream:
        return (message + '}').encode()
    return ('event: message_start\ndata: {"type":"message_start","message":' + message
            + '}}\n\n'
            'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
            '"end_turn"},"usage":' + usage + '}\n\n'
            'event: message_stop\ndata: {"type":"message_stop"}\n\n').encode()


class HostileDecode:
    """A decode answering ``decode_answer`` of the usage it is given."""

    def __init__(self) -> None:
        self.usage = "{}"
        self.cut = 0  # streamed: written in pieces of this many bytes, each read apart
        self.coalesce = False  # the pieces back to back: several chunks in one read
        self.sent: list[bytes] = []
        self.backend = ScriptedBackend(self._answer)

    async def _answer(self, request: Any, responder: Any) -> None:
        stream = bool(json.loads(request.body).get("stream"))
        raw = decode_answer(request.path, self.usage, stream)
        self.sent.append(raw)
        if not stream:
            await responder.send_bytes(200, raw)
            return
        await responder.start(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
        if self.cut:  # as TCP segments or TLS records may cut them on a real network
            for start in range(0, len(raw), self.cut):
                await responder.write(raw[start:start + self.cut])
                if not self.coalesce:
                    await asyncio.sleep(0.003)  # its own read at the proxy
        else:
            for event in raw.split(b"\n\n")[:-1]:  # one event per write, as vLLM writes
                await responder.write(event + b"\n\n")
        await responder.end()


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[tuple[Any, HostileDecode]]:
    prefill = await DemoBackend("prefill", prompt_tokens_details=True).start()
    decode = HostileDecode()
    await decode.backend.start()
    try:
        config = config_for(prefill.url, decode.backend.url(), kv_protocol="relay",
                            rewrite_cached_tokens=True)
        async with running_proxy(config) as proxy:
            yield proxy, decode
    finally:
        await decode.backend.close()
        await prefill.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_usage_the_proxy_cannot_rewrite_is_relayed_as_decode_sent_it(stream):
    async with cluster() as (proxy, decode):
        for path, usage in CASES:
            decode.usage = usage
            reply = await proxy.request("POST", path, dict(BODIES[path], stream=stream))
            assert reply.status == 200, (path, usage, reply.body)
            assert reply.complete, (path, usage)
            assert reply.body == decode.sent[-1], (path, usage)
            assert b"Infinity" not in reply.body or b"Infinity" in decode.sent[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_usage_of_the_right_shape_is_still_rewritten(stream):
    """The control: the same path rewrites a usage it understands (the prefill's 0)."""
    shapes = {CHAT_PATH: '{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":5}}',
              RESPONSES_PATH: '{"input_tokens":5,"input_tokens_details":{"cached_tokens":5}}',
              MESSAGES_PATH: '{"input_tokens":1,"cache_read_input_tokens":4}'}
    async with cluster() as (proxy, decode):
        for path, usage in shapes.items():
            decode.usage = usage
            reply = await proxy.request("POST", path, dict(BODIES[path], stream=stream))
            assert reply.status == 200 and reply.complete
            assert reply.body != decode.sent[-1], path
            assert b'"cached_tokens":0' in reply.body or \
                b'"cache_read_input_tokens":0' in reply.body, reply.body


@pytest.mark.parametrize("cut, coalesce", [(7, False), (61, False), (7, True), (61, True)])
async def test_a_usage_event_cut_across_reads_is_still_rewritten(cut, coalesce):
    """A usage event's data line split over several reads is held until its newline,
    then rewritten: every other byte of decode's stream goes on as it came. Also when
    the cut pieces come back to back, several chunks in one read (a re-chunking hop)."""
    shapes = {CHAT_PATH: '{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":5}}',
              COMPLETIONS_PATH: '{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":5}}',
              RESPONSES_PATH: '{"input_tokens":5,"input_tokens_details":{"cached_tokens":5}}',
              MESSAGES_PATH: '{"input_tokens":1,"cache_read_input_tokens":4}'}
    surfaces = {CHAT_PATH: CHAT, COMPLETIONS_PATH: COMPLETIONS, RESPONSES_PATH: RESPONSES,
                MESSAGES_PATH: MESSAGES}
    async with cluster() as (proxy, decode):
        decode.cut, decode.coalesce = cut, coalesce
        for path, usage in shapes.items():
            decode.usage = usage
            reply = await proxy.request("POST", path, dict(BODIES[path], stream=True))
            assert reply.status == 200 and reply.complete, path
            sent = decode.sent[-1]
            assert b'"cached_tokens":0' in reply.body or \
                b'"cache_read_input_tokens":0' in reply.body, (path, reply.body)
            # The same bytes as the stream rewritten whole, in one read.
            assert reply.body == rewrite_events(surfaces[path], sent, 0), path


# -- the pure rewrite: total on whatever decode sends


HOSTILE_VALUES: list[Any] = ["x", "", 7, -1, 1.5, float("inf"), float("nan"), True, None,
                             [], [["cached_tokens", 1]], {}, {"cached_tokens": "x"}, 10**30]
FIELDS = {CHAT: ("prompt_tokens", "completion_tokens", "prompt_tokens_details"),
          RESPONSES: ("input_tokens", "output_tokens", "input_tokens_details"),
          MESSAGES: ("input_tokens", "output_tokens", "cache_read_input_tokens",
                     "cache_creation_input_tokens")}


@pytest.mark.parametrize("surface", [CHAT, COMPLETIONS, RESPONSES, MESSAGES])
def test_rewrite_never_raises_and_changes_nothing_it_refuses(surface):
    chooser = random.Random(19)
    fields = FIELDS[CHAT if surface == COMPLETIONS else surface]
    for _ in range(2000):
        usage = {field: chooser.choice(HOSTILE_VALUES) for field in fields
                 if chooser.random() < 0.8}
        before = repr(usage)
        if not rewrite_usage(surface, usage, 3):
            assert repr(usage) == before, usage


def test_a_non_finite_number_is_never_written():
    raw = b'{"usage":{"prompt_tokens":5,"total_tokens":1e400},"x":[1e999]}'
    assert rewrite_body(CHAT, raw, 2) is None  # the caller relays raw
    event = b'data: {"choices":[],"usage":{"prompt_tokens":5,"total_tokens":-1e400}}\n\n'
    assert rewrite_events(CHAT, event, 2) == event
    fine = b'data: {"choices":[],"usage":{"prompt_tokens":5,"total_tokens":1e300}}\n\n'
    out = rewrite_events(CHAT, fine, 2)
    assert b'"cached_tokens":2' in out and b"Infinity" not in out


def test_a_rewritten_answer_keeps_every_other_byte_of_decode():
    raw = ('{"id": "chatcmpl-1", "choices": [{"message": {"content": "caf\u00e9 \\u00e9 "'
           '}}],\n "usage": {"prompt_tokens": 5, "completion_tokens": 2},\n'
           ' "kv_transfer_params": null}').encode()
    out = rewrite_body(CHAT, raw, 3)
    assert out is not None
    head, tail = raw.split(b'{"prompt_tokens"', 1)
    assert out.startswith(head) and out.endswith(b',\n "kv_transfer_params": null}')
    assert json.loads(out)["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 3}}


@pytest.mark.parametrize("raw", [
    # the key spelled with an escape, and "usage" elsewhere: whole answer written again
    b'{"role":"usage","\\u0075sage":{"prompt_tokens":5}}',
    # two usage keys: the later one counts, which a byte search cannot tell
    b'{"usage":{"prompt_tokens":9},"usage":{"prompt_tokens":5}}',
    # a nested usage and the top-level one
    b'{"choices":[{"usage":{"prompt_tokens":1}}],"usage":{"prompt_tokens":5}}',
])
def test_an_answer_whose_usage_bytes_are_not_certain_is_written_whole(raw):
    out = rewrite_body(CHAT, raw, 2)
    assert out is not None
    assert json.loads(out)["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert json.loads(out) == {**json.loads(raw), "usage": json.loads(out)["usage"]}


async def test_an_answer_too_big_to_hold_for_its_usage_goes_on_as_decode_sent_it():
    """Read whole to rewrite one figure, 60 MB answers (a few at once) took the
    process past a gigabyte: past 1 MiB a length-framed answer is relayed as it came."""
    pad = "y" * (1024 * 1024)
    async with cluster() as (proxy, decode):
        decode.usage = '{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":5}}'
        small = await proxy.request("POST", CHAT_PATH, BODIES[CHAT_PATH])
        assert small.body != decode.sent[-1]  # rewritten (the prefill's 0)
        decode.usage = ('{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":5},'
                        f'"pad":"{pad}"}}')
        big = await proxy.request("POST", CHAT_PATH, BODIES[CHAT_PATH])
        assert big.status == 200 and big.complete
        assert big.body == decode.sent[-1]  # byte for byte
