"""How the settings become command-line flags: one Setting, one flag (or a pair).

A boolean setting is a pair of flags (``--trace`` / ``--no-trace``); the first
also takes a value as its variable does (1/0, true/false, yes/no, on/off), so
``--trace 0`` still means what it meant before the flag was a switch. Every other flag takes a
value whose metavar says what it is (``--port PORT``, ``--prefill URL``).

A mistake on the command line (an unknown flag, a missing value) raises
UsageError instead of argparse's exit with the whole usage: the daemon prints
one line naming the flag and one short usage line, or one JSON line.
"""

from __future__ import annotations

import argparse
import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

from .values import bool_value, endpoints, optional_seconds, seconds_value

SHORT_USAGE = "usage: lowproxy [--FLAG VALUE | --FLAG | --no-FLAG]... (lowproxy --help lists all)"


class UsageError(ValueError):
    """A command line argparse cannot read; the message names the flag."""


@dataclass(frozen=True)
class Setting:
    field: str
    env: str
    flag: str
    parse: Callable[[str], Any]
    default: str
    help: str
    repeatable: bool = False  # the flag may be given several times (joined by commas)

    @property
    def boolean(self) -> bool:
        return self.parse is bool_value

    @property
    def flags(self) -> str:
        """The flag as the README and --help show it: ``--trace / --no-trace`` for a pair."""
        return f"{self.flag} / --no-{self.flag[2:]}" if self.boolean else self.flag

    @property
    def metavar(self) -> str:
        """What the value is: FILE, KEY, SECONDS, URL, PORT, N, {a,b}, or the field's name."""
        for suffix, shown in (("_file", "FILE"), ("_key", "KEY"), ("_keys", "KEYS"),
                              ("_status", "STATUS"), ("_message", "TEXT")):
            if self.field.endswith(suffix):
                return shown
        if self.field.endswith("port"):
            return "PORT"
        if getattr(self.parse, "metavar", None):  # int_in, choice (config_values)
            return str(self.parse.metavar)  # type: ignore[attr-defined]
        if self.parse in (seconds_value, optional_seconds):
            return "SECONDS"
        if self.parse is endpoints:
            return "URL"
        return self.field.upper()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(_with_hint(message, self._flag_names()))

    def _flag_names(self) -> list[str]:
        return [name for action in self._actions for name in action.option_strings]


def _unrecognized(words: list[str]) -> str:
    """Unrecognized arguments as shown: a misspelt flag's value is not (it may be a
    key: ``--admin-api-kye SECRET``), only the flag."""
    shown = []
    for word in words:
        name, equals, _ = word.partition("=")
        # Only what has a long flag's shape is shown; any other word may be a
        # value (a key can start with "-", or hold spaces argparse split on).
        shown.append(name + ("=..." if equals else "") if _FLAG.fullmatch(name) else "...")
    return " ".join(shown)


_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")


def _with_hint(message: str, flags: list[str]) -> str:
    """argparse's message, plus the flag meant when one was misspelt."""
    if message.startswith("unrecognized arguments:"):
        words = message.split(":", 1)[1].split()
        message = f"unrecognized arguments: {_unrecognized(words)}"
        for word in words:
            close = difflib.get_close_matches(word.partition("=")[0], flags, n=1, cutoff=0.6)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    if message.endswith("expected one argument"):
        return f"{message} (a value that starts with '-' is written --FLAG=VALUE)"
    return message


def build_parser(settings: Sequence[Setting]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lowproxy", allow_abbrev=False,  # --p must not silently mean --port
        description="Prefill/decode proxy for disaggregated LLM serving. Every flag "
        "also reads the environment variable shown; a flag wins over its variable.",
    )
    for setting in settings:
        described = f"{setting.help} (env {setting.env}, default {setting.default!r})"
        if setting.boolean:
            # --trace alone turns it on; --trace 0 / --trace=1 (what the flag took
            # before it was a switch) keep working, parsed like the variable.
            parser.add_argument(setting.flag, dest=setting.field, nargs="?", const="1",
                                metavar="BOOL", help=described)
            parser.add_argument("--no-" + setting.flag[2:], dest=setting.field,
                                action="store_const", const="0",
                                help=f"= {setting.flag} 0 (env {setting.env}=0)")
        else:
            parser.add_argument(setting.flag, dest=setting.field,
                                action="append" if setting.repeatable else "store",
                                metavar=setting.metavar, help=described)
    parser.add_argument("--demo", action="store_true",
                        help="start embedded emulated vLLM prefill and decode backends "
                        "and proxy to them")
    parser.add_argument("--version", action="store_true",
                        help="print the version and bundled dependency versions")
    return parser


def flag_text(setting: Setting, flagged: Any) -> str:
    """What a given flag stands for, as the setting's variable would hold it."""
    return ",".join(flagged) if setting.repeatable else str(flagged)


__all__ = ["SHORT_USAGE", "Setting", "UsageError", "build_parser", "flag_text"]
