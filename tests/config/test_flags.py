"""Command-line flags: boolean pairs, metavars, errors that name the flag, a short usage."""

from __future__ import annotations

import json

import pytest

from helpers import CHAT, Daemon, ScriptedBackend, chat, free_port, request
from lowproxy.config.settings import SETTINGS, ConfigError, build_parser, load_config

BASE = {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0", "PD_PROXY_LOOP": "asyncio",
        "PD_PROXY_HEALTH_INTERVAL_SECONDS": "0"}
BOOLEANS = [setting for setting in SETTINGS if setting.boolean]


def test_every_boolean_setting_is_a_pair_of_flags():
    assert {s.field for s in BOOLEANS} >= {"trace", "otel", "forward_authorization",
                                           "rewrite_cached_tokens", "upstream_keepalive",
                                           "forward_prompt_token_ids"}
    for setting in BOOLEANS:
        on, _ = load_config([setting.flag], {setting.env: "0"})
        off, _ = load_config(["--no-" + setting.flag[2:]], {setting.env: "1"})
        assert getattr(on, setting.field) is True, setting.flag
        assert getattr(off, setting.field) is False, setting.flag


@pytest.mark.parametrize("text, value", [("1", True), ("yes", True), ("on", True),
                                         ("true", True), ("0", False), ("off", False),
                                         ("", False)])
def test_the_variables_take_the_same_values_as_before(text, value):
    assert load_config([], {"PD_PROXY_TRACE": text})[0].trace is value


def test_a_value_after_the_flag_still_means_what_it_meant():
    # Scripts written before the flags were switches: --otel 0 is still off.
    assert load_config(["--otel", "0"], {"PD_PROXY_OTEL": "1"})[0].otel is False
    assert load_config(["--otel=yes"], {})[0].otel is True
    assert load_config(["--trace", "--otel"], {})[0].otel is True


def test_a_bad_boolean_variable_names_the_variable():
    with pytest.raises(ConfigError) as caught:
        load_config([], {"PD_PROXY_OTEL": "maybe"})
    assert str(caught.value).startswith("PD_PROXY_OTEL:")


def test_metavars_read_as_values():
    usage = " ".join(build_parser().format_usage().split())  # as one line, wherever it wraps
    for shown in ("--port PORT", "--prefill URL", "--ca-file FILE", "--prefill-timeout SECONDS",
                  "--workers N", "--trace [BOOL]] [--no-trace]",
                  "--kv-protocol {relay,mooncake,sglang}"):
        assert shown in usage, shown
    assert "PD_PROXY_" not in usage  # the variables are in the help text, not the metavars


def _refused(args: list[str], env: dict[str, str] | None = None) -> list[str]:
    daemon = Daemon(args, {**BASE, **(env or {})})
    assert daemon.proc.wait(30) == 2
    output = daemon.output()
    assert "Traceback" not in output and "listening on" not in output
    return [line for line in output.splitlines() if line.strip()]


def test_a_flag_mistake_names_the_flag_with_a_short_usage():
    first, usage = _refused(["--trcae"])
    assert "--trcae" in first and "did you mean --trace?" in first
    assert usage.startswith("usage: lowproxy") and len(usage) < 100
    first, usage = _refused(["--port"])
    assert "--port" in first and "expected one argument" in first
    # A value that does not parse: one line naming the flag, or the variable.
    [line] = _refused(["--trace=maybe"], {"PD_PROXY_TRACE": "1"})
    assert line.startswith("lowproxy: --trace:") and "'maybe'" in line
    [line] = _refused(["--port", "eighty"], {"PD_PROXY_PORT": "8000"})
    assert line.startswith("lowproxy: --port:") and "PD_PROXY_PORT" not in line
    [line] = _refused([], {"PD_PROXY_PORT": "eighty"})
    assert line.startswith("lowproxy: PD_PROXY_PORT:")


def test_a_misspelt_flag_is_named_without_its_value():
    """The value after an unknown flag may be the key it was meant to set."""
    first, _ = _refused(["--admin-api-kye", "S3CRET-A"])
    assert "--admin-api-kye" in first and "did you mean --admin-api-key?" in first
    assert "S3CRET" not in first
    first, _ = _refused(["--admin-api-kye=S3CRET-B", "stray"])
    assert "--admin-api-kye=..." in first and "S3CRET" not in first
    for value in ("-S3CRET-D", "top S3CRET words"):  # a key starting with "-", or spaced
        first, _ = _refused(["--admin-api-kye", value])
        assert "--admin-api-kye" in first and "S3CRET" not in first, first
    # A URL's password is masked where a bad URL is quoted.
    [line] = _refused(["--decode", "user:S3CRET-C@backend:8000"])
    assert line.startswith("lowproxy: --decode:") and "***@backend:8000" in line
    assert "S3CRET" not in line


def test_start_checks_name_the_flags_given():
    [line] = _refused(["--client-api-keys-file", "/"])
    assert line.startswith("lowproxy: --client-api-keys-file:") and "PD_PROXY_" not in line
    port = str(free_port())
    [line] = _refused(["--port", port, "--metrics-port", port])
    assert "--metrics-port" in line and "(--port)" in line and "PD_PROXY_" not in line
    [line] = _refused([], {"PD_PROXY_PORT": port, "PD_PROXY_METRICS_PORT": port})
    assert "PD_PROXY_METRICS_PORT" in line and "(PD_PROXY_PORT)" in line


def test_a_flag_mistake_under_json_logs_is_one_json_line():
    [line] = _refused(["--log-format", "json", "--trcae"])
    entry = json.loads(line)
    assert entry["level"] == "error" and "did you mean --trace?" in entry["message"]
    assert entry["usage"].startswith("usage: lowproxy")
    [line] = _refused(["--otel=maybe"], {"PD_PROXY_LOG_FORMAT": "json"})
    assert json.loads(line)["setting"] == "--otel"


async def _traceparent_at_decode(args: list[str], env: dict[str, str]) -> bytes | None:
    decode = await ScriptedBackend().start()
    daemon = Daemon(args, {**BASE, "PD_PROXY_DECODE_URL": decode.url(), **env})
    try:
        port = daemon.wait_listening()
        assert (await request(port, "POST", CHAT, chat())).status == 200
        [received] = decode.received
        return received.header("traceparent")
    finally:
        assert daemon.stop() == 0
        await decode.close()


async def test_trace_and_no_trace_over_the_daemon():
    started = await _traceparent_at_decode(["--trace"], {})
    assert started is not None and started.startswith(b"00-")
    assert await _traceparent_at_decode(["--no-trace"], {"PD_PROXY_TRACE": "1"}) is None
