"""The legs of a large request serialised with the prompt encoded once (legs.SharedEncoding).

Pure: every leg SharedEncoding writes must be the bytes serialise() writes for it,
whatever the values (unicode, lone surrogates, floats, big ints, nesting), and a
value the leg changed must never be taken from the client's encoding.
"""

from __future__ import annotations

import json
import random

import pytest

from lowproxy.handshakes.legs import (
    SHARED_ENCODING_MIN_BYTES,
    SharedEncoding,
    leg_serialiser,
    mooncake_bodies,
    relay_decode_body,
    relay_prefill_body,
    serialise,
)
from lowproxy.routes import CHAT, COMPLETIONS, MESSAGES, RESPONSES

ODD_VALUES = ["caf\u00e9", "\ud800 lone", "\"quoted\" \\ \n\t\x00", "", 0, -7, 2 ** 70, 1.5,
              1e-7, 1e300, -0.0, True, False, None, [], {}, [1, "a", None, [2.5]],
              {"nested": {"k": ["\u2028", 3]}, "": 1}]


def client_body(size: int, chooser: random.Random) -> dict:
    body = {"model": "demo-model", "max_tokens": 16, "temperature": 0.7,
            "messages": [{"role": "system", "content": "x" * size},
                         {"role": "user", "content": "caf\u00e9 \ud83d\ude00 question?"}]}
    for index in range(4):
        body[f"extra_{index}"] = chooser.choice(ODD_VALUES)
    return body


@pytest.mark.parametrize("seed", range(20))
def test_every_leg_is_written_as_serialise_writes_it(seed):
    chooser = random.Random(seed)
    body = client_body(SHARED_ENCODING_MIN_BYTES, chooser)
    shared = SharedEncoding(body)
    legs = [relay_prefill_body(body, CHAT),
            relay_decode_body(body, {"remote_engine_id": "e", "remote_block_ids": [[1, 2]]}),
            *mooncake_bodies(body, "xfer-1", "eng_dp0", "http://10.0.0.5:8998", CHAT), body]
    for leg in legs:
        assert shared.serialise(leg) == serialise(leg)
        assert json.loads(shared.serialise(leg)) == json.loads(serialise(leg))


def test_a_value_a_leg_changed_is_written_as_the_leg_has_it():
    body = {"model": "m", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": "y" * 4096}]}
    shared = SharedEncoding(body)
    first = shared.serialise(body)  # every value cached as the client's
    leg = dict(body, max_tokens=1, stream=False, messages=[{"role": "user", "content": "z"}])
    assert shared.serialise(leg) == serialise(leg)
    assert shared.serialise(body) == first


@pytest.mark.parametrize("surface", [CHAT, COMPLETIONS, RESPONSES, MESSAGES])
def test_small_bodies_are_written_whole_and_large_ones_shared(surface):
    body = {"model": "m", "prompt": "p"}
    assert leg_serialiser(body, SHARED_ENCODING_MIN_BYTES - 1) is serialise
    shaped = relay_prefill_body(body, surface)
    assert leg_serialiser(body, SHARED_ENCODING_MIN_BYTES)(shaped) == serialise(shaped)


def test_a_leg_carries_the_clients_text_as_utf8():
    body = {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \u2028 \U0001f600"}]}
    written = serialise(body)
    assert "caf\u00e9 \u2028 \U0001f600".encode() in written  # not \\u escapes
    assert json.loads(written) == body


def test_a_lone_surrogate_is_written_escaped_and_the_leg_still_goes():
    # A client may send "\ud800" (valid JSON escape, not encodable as UTF-8).
    body = json.loads('{"model": "m", "prompt": "a\\ud800b caf\\u00e9", "n": 1}')
    written = serialise(body)
    assert b"a\\ud800b caf\\u00e9" in written
    assert json.loads(written) == body
    large = dict(body, prompt=body["prompt"] * (SHARED_ENCODING_MIN_BYTES // 8))
    assert SharedEncoding(large).serialise(large) == serialise(large)
