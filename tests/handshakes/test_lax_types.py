"""lax_types against pydantic itself: what vLLM's request models make of a JSON value.

pydantic is not a lowproxy dependency, but the openai SDK the tests use brings
it, and it is what vLLM validates with (FastAPI: lax, python mode). A table
of the values that matter first, then hypothesis over strings and numbers.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowproxy.lax_types import as_bool, as_int, is_int_list, is_str_list

pydantic = pytest.importorskip(
    "pydantic", reason="pydantic comes with the openai client of the test extra")

_INT = pydantic.TypeAdapter(int)
_BOOL = pydantic.TypeAdapter(bool)
_INT_LIST = pydantic.TypeAdapter(list[int])
_STR_LIST = pydantic.TypeAdapter(list[str])


def _pydantic(adapter, value):
    try:
        return adapter.validate_python(value)
    except pydantic.ValidationError:
        return None


@pytest.mark.parametrize("value, made", [
    (5, 5), (-1, -1), (2 ** 70, 2 ** 70), (True, 1), (False, 0),
    (5.0, 5), (-0.0, 0), (9.2e18, 9200000000000000000),
    ("5", 5), (" 5 ", 5), ("\t5\n", 5), ("\u3000" + "5", 5), ("+5", 5), ("-5", -5),
    ("5.0", 5), ("5.000", 5), ("-5.0", -5), ("1_000", 1000), ("1_000.0", 1000), ("007", 7),
    ("99999999999999999999", 99999999999999999999),
    # refused
    (5.5, None), (0.1 + 0.2, None), (2.0 ** 63, None), (-(2.0 ** 63), None), (1e300, None),
    ("abc", None), ("3x", None), ("", None), ("5.", None), (".0", None), ("5.5", None),
    ("5.01", None), ("1e3", None), ("0x10", None), ("1__0", None), ("_1", None), ("1_", None),
    ("+ 5", None), ("--5", None), ("\u0665", None), ("\uff15", None), ("5\x00", None),
    ("\x1c5", None), ("1" * 4301, None), ("1" * 4300 + "_1", None), (None, None), ([5], None),
    ({}, None),
    # pydantic-core's cleaning quirks: zeros and underscores first, then a minus sign
    ("0-5", -5), ("0__1", 1), ("+0-0", 0), ("0-05", None), ("0-0_0", None),
])
def test_int_as_pydantic_lax_makes_it(value, made):
    assert as_int(value) == made
    assert _pydantic(_INT, value) == made


@pytest.mark.parametrize("value, made", [
    (True, True), (False, False), (0, False), (1, True), (0.0, False), (1.0, True),
    (-0.0, False), ("true", True), ("True", True), ("TRUE", True), ("yes", True),
    ("Y", True), ("on", True), ("t", True), ("1", True), ("false", False), ("no", False),
    ("off", False), ("F", False), ("n", False), ("0", False),
    # refused
    (2, None), (-1, None), (0.5, None), ("maybe", None), (" true", None), ("true ", None),
    ("", None), ("2", None), ("1.0", None), ("00", None), (None, None), ([], None), ({}, None),
])
def test_bool_as_pydantic_lax_makes_it(value, made):
    assert as_bool(value) is made
    assert _pydantic(_BOOL, value) is made


@pytest.mark.parametrize("value, ok", [
    ([], True), ([1, 2], True), (["5", 5.0, True], True),
    (["a"], False), ([5.5], False), ([None], False), ([[1]], False), (5, False),
    ("1,2", False), ({"a": 1}, False), (None, False),
])
def test_int_lists(value, ok):
    assert is_int_list(value) is ok
    assert (_pydantic(_INT_LIST, value) is not None) is ok


@pytest.mark.parametrize("value, ok", [
    ([], True), (["a", ""], True),
    ([5], False), (["a", 5], False), ([True], False), ([None], False), ("a", False),
    (None, False),
])
def test_str_lists(value, ok):
    assert is_str_list(value) is ok
    assert (_pydantic(_STR_LIST, value) is not None) is ok


# Text built from what an integer's or a bool's text is made of, and what tries it.
_NUMBER_ALPHABET = st.sampled_from(list("0123456789+-_.eExX ") + [
    "\t", "\n", "\x0b", "\x1c", "\xa0", "\u2003", "\u3000", "\u0665", "\uff15"])
_BOOL_WORDS = st.sampled_from(["true", "false", "yes", "no", "on", "off", "t", "f", "y",
                               "n", "1", "0", "maybe", ""])


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(_NUMBER_ALPHABET, max_size=24), st.integers(),
                 st.floats(allow_nan=False, allow_infinity=False), st.booleans()))
def test_int_agrees_with_pydantic_everywhere(value):
    assert as_int(value) == _pydantic(_INT, value)


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    _BOOL_WORDS.flatmap(lambda w: st.sampled_from([w, w.upper(), w.title(), f" {w}", f"{w}\n"])),
    st.text(max_size=5), st.integers(-3, 3), st.floats(-2, 2), st.booleans()))
def test_bool_agrees_with_pydantic_everywhere(value):
    assert as_bool(value) is _pydantic(_BOOL, value)


def test_int_agrees_with_pydantic_on_every_short_text():
    # pydantic-core's cleaning quirks live in short texts ("0-5" is -5, "0__1" is 1).
    texts = ["".join(chars) for size in range(1, 5)
             for chars in itertools.product("0-_+.5 ", repeat=size)]
    assert [t for t in texts if as_int(t) != _pydantic(_INT, t)] == []


def test_values_come_as_strict_json_parses_them():
    # What the client's body holds: json's own types, never Decimal or bytes.
    body = json.loads('{"a": 5.0, "b": 5, "c": "5", "d": true}')
    assert [as_int(v) for v in body.values()] == [5, 5, 5, 1]
