"""Requirements and environment markers for lowproxy.pack (a PEP 508 subset).

Enough of PEP 508 for the dependency tree of h11 and httpcore: names, extras
and markers over the Python version, platform and ``extra``. Anything else is
refused with a PackError rather than guessed. No third-party parser
(``packaging``) is used so that ``python -m lowproxy.pack`` needs nothing
beyond what ``pip install .`` brings.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


class PackError(Exception):
    """The archive cannot be built; the message says why and what to do."""


_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?"
    r"[^;]*(?:;(?P<marker>.*))?$")
_MARKER_TOKEN = re.compile(
    r"\s*(?:(?P<string>'[^']*'|\"[^\"]*\")|(?P<op>===|==|!=|~=|<=|>=|<|>|\(|\))"
    r"|(?P<word>not\s+in\b|[A-Za-z_][A-Za-z0-9_.]*))")
_VERSION_VARIABLES = frozenset({"python_version", "python_full_version"})


@dataclass(frozen=True)
class Requirement:
    name: str
    extras: frozenset[str]
    marker: str


def parse_requirement(text: str) -> Requirement:
    match = _REQUIREMENT.match(text)
    if not match:
        raise PackError(f"cannot parse requirement {text!r}")
    extras = frozenset(normalize(e) for e in (match.group("extras") or "").split(",")
                       if e.strip())
    return Requirement(normalize(match.group("name")), extras,
                       (match.group("marker") or "").strip())


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def target_environment(version: tuple[int, int]) -> dict[str, str]:
    """Marker variables of a CPython on Linux (the images this runs in)."""
    text = f"{version[0]}.{version[1]}"
    return {"python_version": text, "python_full_version": text + ".0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux"}


def marker_applies(marker: str, environment: dict[str, str], extras: Iterable[str]) -> bool:
    """Evaluate a PEP 508 marker; ``extra`` is true for any of ``extras``."""
    if not marker:
        return True
    return any(_MarkerParser(marker, {**environment, "extra": extra}).evaluate()
               for extra in ("", *extras))


class _MarkerParser:
    """Recursive descent over: or-expr := and-expr ('or' and-expr)* ; and so on."""

    def __init__(self, text: str, environment: dict[str, str]) -> None:
        self.text = text
        self.environment = environment
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            if text[position:].strip() == "":
                break
            match = _MARKER_TOKEN.match(text, position)
            if not match:
                raise PackError(f"cannot parse marker {text!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.index = 0

    def evaluate(self) -> bool:
        value = self._or()
        if self.index != len(self.tokens):
            raise PackError(f"cannot parse marker {self.text!r}")
        return value

    def _peek(self) -> str:
        return self.tokens[self.index][1] if self.index < len(self.tokens) else ""

    def _next(self) -> tuple[str, str]:
        if self.index >= len(self.tokens):
            raise PackError(f"marker {self.text!r} ends too early")
        token = self.tokens[self.index]
        self.index += 1
        return token

    def _or(self) -> bool:
        value = self._and()
        while self._peek() == "or":
            self._next()
            value = self._and() or value
        return value

    def _and(self) -> bool:
        value = self._atom()
        while self._peek() == "and":
            self._next()
            value = self._atom() and value
        return value

    def _atom(self) -> bool:
        if self._peek() == "(":
            self._next()
            value = self._or()
            if self._next()[1] != ")":
                raise PackError(f"unbalanced parentheses in marker {self.text!r}")
            return value
        left_kind, left = self._next()
        _, op = self._next()
        right_kind, right = self._next()
        variable = left if left_kind == "word" else right
        if variable not in self.environment:
            raise PackError(f"marker variable {variable!r} is not supported in {self.text!r}")
        left_value = self._value(left_kind, left)
        right_value = self._value(right_kind, right)
        return _compare(left_value, " ".join(op.split()), right_value,
                        as_version=variable in _VERSION_VARIABLES)

    def _value(self, kind: str, token: str) -> str:
        if kind == "string":
            return token[1:-1]
        return self.environment[token]


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _compare(left: str, op: str, right: str, as_version: bool) -> bool:
    if op == "in":
        return left in right
    if op == "not in":
        return left not in right
    if not as_version:
        if op in ("==", "==="):
            return normalize(left) == normalize(right)
        if op == "!=":
            return normalize(left) != normalize(right)
        raise PackError(f"operator {op!r} needs a version")
    a, b = _version_key(left), _version_key(right)
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    if op == "~=":
        prefix = _version_key(right)[:-1]
        return a >= b and a[:len(prefix)] == prefix
    comparisons = {"==": a == b, "===": left == right, "!=": a != b, "<": a < b,
                   "<=": a <= b, ">": a > b, ">=": a >= b}
    if op not in comparisons:
        raise PackError(f"unknown marker operator {op!r}")
    return comparisons[op]
