"""Pydantic v2's lax conversions for the few field types vLLM's request models use.

vLLM's OpenAI server validates a request with FastAPI, that is pydantic's
lax (python-mode) validation of the parsed JSON: an ``int`` field takes
``"5"``, ``5.0`` and ``true``; a ``bool`` field takes ``"yes"`` and ``0``.
lowproxy cannot ask pydantic (it is not a dependency), so these pure functions
say what it would make of a JSON value, or None where it refuses it. They
follow pydantic's conversion table and, where it is silent, pydantic-core's
own parsing (str_as_int, clean_int_str, float_as_int, str_as_bool, pydantic
2.14); tests/handshakes/test_lax_types.py holds them against pydantic itself.
Only the types of JSON (str, int, float, bool, None, list, dict) come here.
"""

from __future__ import annotations

import math
import re
from typing import Any

# What Rust's str::trim takes off a number's text (Unicode White_Space), which
# is not Python's str.strip(): that also strips U+001C..U+001F.
_RUST_WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                    "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
# The one integer text pydantic-core parses (jiter's: a JSON integer); any other
# text must first clean into one (_cleaned). Past 4300 digits it is refused.
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)", re.ASCII)
_MAX_DIGITS = 4300
# A float becomes an int only inside i64, both bounds excluded (float_as_int).
_I64_BOUND = 2.0 ** 63

_TRUE_TEXT = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE_TEXT = frozenset(("0", "off", "f", "false", "n", "no"))


def as_int(value: Any) -> int | None:
    """The int pydantic's lax ``int`` makes of ``value``; None where it refuses it."""
    kind = type(value)
    if kind is int or kind is bool:
        return int(value)
    if kind is float:
        if not math.isfinite(value) or not value.is_integer() \
                or not -_I64_BOUND < value < _I64_BOUND:
            return None
        return int(value)
    if kind is str:
        text = value if _json_int(value) else _cleaned(value)
        return None if text is None or not _json_int(text) else int(text)
    return None


def _json_int(text: str) -> bool:
    return len(text) <= _MAX_DIGITS + 1 and _JSON_INT.fullmatch(text) is not None \
        and len(text) - text.startswith("-") <= _MAX_DIGITS


def _cleaned(text: str) -> str | None:
    """pydantic-core's clean_int_str: " +007.00 " -> "7", "1_000" -> "1000", or None.

    Its quirks kept, since vLLM serves what they let through: underscores among
    leading zeros ("0__1" is 1) and a minus sign after them ("0-5" is -5).
    """
    before = len(text)
    text = text.strip(_RUST_WHITESPACE)
    if text.startswith("+"):
        text = text[1:]
        if text.startswith("-"):
            return None
    negative = text.startswith("-")
    if negative:
        text = text[1:]
        if text.startswith(("-", "+")):
            return None
    stripped = _without_leading_zeros(text)
    if stripped is None:
        return None
    text = stripped
    point = text.find(".")
    if point >= 0 and len(text) > point + 1 and text[point + 1:].strip("0") == "":
        text = text[:point]
    if "_" in text and "__" not in text and not text.startswith("_") \
            and not text.endswith("_"):
        text = text.replace("_", "")
    elif len(text) == before:
        return None
    return "-" + text if negative else text


def _without_leading_zeros(text: str) -> str | None:
    """pydantic-core's strip_leading_zeros: one zero kept ("000" -> "0", "00.0" -> "0.0")."""
    if not text or not (text[0] == "0" or "1" <= text[0] <= "9" or text[0] == "-"):
        return None
    if text[0] != "0":
        return text
    rest = text.lstrip("0_")  # at C speed: a string of millions of zeros is one call
    if not rest:
        return text[-1]
    char = rest[0]
    if "1" <= char <= "9" or char == "-":
        return rest
    if char == ".":
        return text[len(text) - len(rest) - 1:]
    return None


def as_bool(value: Any) -> bool | None:
    """The bool pydantic's lax ``bool`` makes of ``value``; None where it refuses it."""
    kind = type(value)
    if kind is bool:
        return bool(value)
    if kind is int or kind is float:
        # 0 and 1 only (0.0, -0.0 and 1.0 too); any other number is refused.
        return bool(value) if value in (0, 1) else None
    if kind is str and value.isascii():  # eq_ignore_ascii_case; no trimming: " t" is refused
        text = value.lower()
        if text in _TRUE_TEXT:
            return True
        if text in _FALSE_TEXT:
            return False
    return None


def is_true(value: Any) -> bool:
    """Whether pydantic's lax ``bool`` makes True of ``value`` ("true", 1, "yes"...)."""
    return value is True or (value is not None and value is not False
                             and as_bool(value) is True)


def is_int(value: Any) -> bool:
    return as_int(value) is not None


def is_bool(value: Any) -> bool:
    return as_bool(value) is not None


# Items of a list walked one by one through the lax int rules, at most: past it a
# list that is not all plain ints is refused (a 32 MiB body of numeric strings held
# the event loop for seconds; no client sends thousands of ids as strings).
MAX_LAX_ITEMS = 16384


def is_int_list(value: Any) -> bool:
    """``list[int]``: a JSON array whose every item is an int to pydantic.

    The items' types are gathered at C speed first: a list of plain ints (all
    but every client's) is not walked item by item. A list of more than
    MAX_LAX_ITEMS items that are not all plain ints is refused unwalked."""
    if type(value) is not list:
        return False
    if set(map(type, value)) <= _INT_ONLY:
        return True
    return len(value) <= MAX_LAX_ITEMS and all(as_int(item) is not None for item in value)


def is_str_list(value: Any) -> bool:
    """``list[str]``: strings only; a number is never a string to pydantic."""
    return type(value) is list and set(map(type, value)) <= _STR_ONLY


_INT_ONLY, _STR_ONLY = frozenset({int}), frozenset({str})
