"""The depth walk (strict_json.nested_deeper_than) against a plain recursive depth.

It runs on the event loop for every body of more than MAX_DEPTH brackets, so
it walks level by level with C-level filters (a 32 MiB body of small messages
took seconds with a Python stack of pairs); the answer must stay exact.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowproxy.handshakes import strict_json


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                      lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=2), inner, max_size=4),
                      max_leaves=60)


@settings(max_examples=300, deadline=None)
@given(values, st.integers(min_value=0, max_value=8))
def test_the_walk_agrees_with_the_recursive_depth(value, limit):
    assert strict_json.nested_deeper_than(value, limit) == (depth(value) > limit)


def test_a_deep_chain_under_many_flat_members_is_found():
    flat = [{"role": "user", "content": "a"}] * 5000
    deep: Any = "x"
    for _ in range(strict_json.MAX_DEPTH):
        deep = [deep]
    body = json.dumps({"messages": flat, "tools": [{"schema": deep}]}).encode()
    assert depth(json.loads(body)) > strict_json.MAX_DEPTH
    with pytest.raises(strict_json.TooDeep):
        strict_json.loads(body)
    wide = json.dumps({"messages": flat}).encode()
    assert strict_json.loads(wide)["messages"] == flat
