"""Configuration: PD_PROXY_* variables, their flags, defaults, and bad values.

load_config is tested as a pure function of (argv, environ); the daemon is run
as a child process for what only the process shows (exit status 2, one line).
"""

from __future__ import annotations

import pytest

from helpers import Daemon, free_port, request
from lowproxy.config import Config, ConfigError, load_config, parse_endpoint


def load(env: dict[str, str] | None = None, argv: list[str] | None = None) -> Config:
    config, _ = load_config(argv or [], env or {})
    return config


# -- defaults and the GCO variables


def test_defaults_match_the_gco_proxy():
    config = load()
    assert config.host == "0.0.0.0"
    assert config.port == 8000
    assert config.prefill == () and config.decode == ()
    assert config.ca_file == ""
    assert config.no_decode_status == 503
    assert config.no_decode_message == "no available decode backend"
    assert config.admin_api_key == ""
    assert config.log_level == "info"
    assert config.prefill_timeout == 300.0


def test_every_gco_variable_is_read():
    config = load({
        "PD_PROXY_HOST": "127.0.0.2",
        "PD_PROXY_PORT": "9123",
        "PD_PROXY_PREFILL_URL": "http://prefill.svc:8100",
        "PD_PROXY_DECODE_URL": "https://decode.svc:8200",
        "PD_PROXY_CA_FILE": "/etc/ca.pem",
        "PD_PROXY_RESIDENCY_TIMEOUT_SECONDS": "0.5",
        "PD_PROXY_NO_DECODE_BACKEND_STATUS": "429",
        "PD_PROXY_NO_DECODE_BACKEND_MESSAGE": "decode is busy",
        "ADMIN_API_KEY": "s3cret",
        "PD_PROXY_LOG_LEVEL": "DEBUG",
        "PD_PROXY_PREFILL_TIMEOUT_SECONDS": "12.5",
    })
    assert config.host == "127.0.0.2"
    assert config.port == 9123
    assert config.prefill == (parse_endpoint("http://prefill.svc:8100"),)
    assert [e.label for e in config.decode] == ["https://decode.svc:8200"]
    assert config.ca_file == "/etc/ca.pem"
    assert config.residency_timeout == 0.5
    assert config.no_decode_status == 429
    assert config.no_decode_message == "decode is busy"
    assert config.admin_api_key == "s3cret"
    assert config.log_level == "debug"
    assert config.prefill_timeout == 12.5


@pytest.mark.parametrize("url", ["http://decode.svc:8200/", "http://decode.svc:8200//",
                                 " http://decode.svc:8200/ "])
def test_trailing_slash_of_a_backend_url_is_ignored(url):
    [decode] = load({"PD_PROXY_DECODE_URL": url}).decode
    assert decode == parse_endpoint("http://decode.svc:8200")
    assert decode.base_path == "" and decode.port == 8200


@pytest.mark.parametrize("url", ["HTTP://decode.svc:8200", "Http://decode.svc:8200/"])
def test_a_backend_urls_scheme_is_read_in_any_case(url):
    # RFC 3986 3.1, and the GCO proxy's httpx: HTTP:// started there, so it starts here.
    [decode] = load({"PD_PROXY_DECODE_URL": url}).decode
    assert decode == parse_endpoint("http://decode.svc:8200")


@pytest.mark.parametrize("value", ["inf", "nan", "-1", " 2 ", "1e3"])
def test_the_unused_residency_timeout_takes_whatever_the_gco_proxy_took(value):
    # float() there, and never used: a manifest saying inf must not crash-loop the pod.
    load({"PD_PROXY_RESIDENCY_TIMEOUT_SECONDS": value})


@pytest.mark.parametrize("url, reason", [
    ("http://p:1/engine/", "no path"), ("http://p:8000/v1", "no path"),
    ("http://p:8000?x=1", "no query"), ("http://p:8000/#frag", "unknown option"),
    ("http://p:80a", "not a port number"), ("http://p:8000#bootstrap_port=x", "not a port")])
def test_a_backend_url_with_a_path_query_or_fragment_is_refused(url, reason):
    # http://h:8000/v1 once sent /v1/v1/...: the client's path is sent as it came.
    with pytest.raises(ConfigError, match=reason):
        load({"PD_PROXY_PREFILL_URL": url})


def test_ca_file_surrounding_spaces_are_ignored():
    assert load({"PD_PROXY_CA_FILE": "  /etc/pd/ca.pem \n"}).ca_file == "/etc/pd/ca.pem"
    assert load({"PD_PROXY_CA_FILE": "   "}).ca_file == ""


def test_no_decode_message_is_kept_verbatim():
    message = "  keine Decode-Instanz frei  "
    assert load({"PD_PROXY_NO_DECODE_BACKEND_MESSAGE": message}).no_decode_message == message


# -- flags


FLAGS = [
    ("PD_PROXY_HOST", "--host", "10.0.0.1", "10.0.0.2", "host"),
    ("PD_PROXY_PORT", "--port", "8001", "8002", "port"),
    ("PD_PROXY_CA_FILE", "--ca-file", "/a.pem", "/b.pem", "ca_file"),
    ("PD_PROXY_RESIDENCY_TIMEOUT_SECONDS", "--residency-timeout", "1", "3", "residency_timeout"),
    ("PD_PROXY_NO_DECODE_BACKEND_STATUS", "--no-decode-status", "502", "504",
     "no_decode_status"),
    ("PD_PROXY_NO_DECODE_BACKEND_MESSAGE", "--no-decode-message", "env says", "flag says",
     "no_decode_message"),
    ("ADMIN_API_KEY", "--admin-api-key", "env-key", "flag-key", "admin_api_key"),
    ("PD_PROXY_LOG_LEVEL", "--log-level", "error", "warning", "log_level"),
    ("PD_PROXY_PREFILL_TIMEOUT_SECONDS", "--prefill-timeout", "7", "9", "prefill_timeout"),
]


@pytest.mark.parametrize("env, flag, env_value, flag_value, field", FLAGS)
def test_each_variable_has_a_flag_and_the_flag_wins(env, flag, env_value, flag_value, field):
    from_env = getattr(load({env: env_value}), field)
    from_flag = getattr(load({}, [flag, flag_value]), field)
    both = getattr(load({env: env_value}, [flag, flag_value]), field)
    assert from_env != from_flag
    assert both == from_flag


def test_backend_flags_win_over_their_variables():
    config = load({"PD_PROXY_PREFILL_URL": "http://env-p:1", "PD_PROXY_DECODE_URL": "http://env-d:2"},
                  ["--prefill", "http://flag-p:3/", "--decode", "http://flag-d:4"])
    assert [e.label for e in config.prefill] == ["http://flag-p:3"]
    assert [e.label for e in config.decode] == ["http://flag-d:4"]


# -- bad values name their setting


@pytest.mark.parametrize("env, value", [
    ("PD_PROXY_PORT", "abc"),
    ("PD_PROXY_PORT", "70000"),
    ("PD_PROXY_LOG_LEVEL", "verbose"),
    ("PD_PROXY_NO_DECODE_BACKEND_STATUS", "abc"),
    ("PD_PROXY_NO_DECODE_BACKEND_STATUS", "99"),
    ("PD_PROXY_PREFILL_TIMEOUT_SECONDS", "soon"),
    ("PD_PROXY_PREFILL_TIMEOUT_SECONDS", "-1"),
    ("PD_PROXY_RESIDENCY_TIMEOUT_SECONDS", "x"),
    ("PD_PROXY_DECODE_URL", "ftp://decode:1"),
    ("PD_PROXY_PREFILL_URL", "http://prefill:notaport"),
])
def test_bad_value_raises_naming_the_variable(env, value):
    with pytest.raises(ConfigError) as caught:
        load({env: value})
    assert str(caught.value).startswith(env + ":")
    assert "\n" not in str(caught.value)


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError) as caught:
        load({"PD_PROXY_PORT": "8000"}, ["--port", "abc"])
    assert str(caught.value).startswith("--port:")


def test_a_good_flag_overrides_a_bad_variable():
    # The variable is never parsed when its flag is given.
    assert load({"PD_PROXY_PORT": "abc"}, ["--port", "8123"]).port == 8123


def test_the_admin_key_is_trimmed_and_must_fit_a_header():
    """A key from a mounted Secret ends in a newline: trimmed, as the other keys are.
    One holding CR/LF inside would split the head of a peer batch (x-admin-api-key):
    refused at start, naming the setting and not the key."""
    assert load({"ADMIN_API_KEY": "adminsecret\n"}).admin_api_key == "adminsecret"
    assert load({"ADMIN_API_KEY": " adminsecret "}).admin_api_key == "adminsecret"
    with pytest.raises(ConfigError) as caught:
        load({"ADMIN_API_KEY": "adminsecret\r\nX-Injected: 1"})
    assert str(caught.value).startswith("ADMIN_API_KEY")
    assert "adminsecret" not in str(caught.value)


def test_repr_hides_the_admin_key():
    config = load({"ADMIN_API_KEY": "very-secret"})
    assert "very-secret" not in repr(config)


# -- the daemon


@pytest.mark.parametrize("env, value", [("PD_PROXY_PORT", "abc"),
                                        ("PD_PROXY_LOG_LEVEL", "chatty"),
                                        ("PD_PROXY_NO_DECODE_BACKEND_STATUS", "oops")])
def test_daemon_exits_2_with_one_line_naming_the_variable(env, value):
    daemon = Daemon([], {env: value})
    status = daemon.proc.wait(30)
    out = daemon.output()
    assert status == 2
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert env in lines[0] and value in lines[0]


def test_daemon_bad_flag_exits_2_naming_the_flag():
    daemon = Daemon(["--port", "abc"])
    assert daemon.proc.wait(30) == 2
    lines = daemon.output().strip().splitlines()
    assert len(lines) == 1 and "--port" in lines[0]


async def test_daemon_reads_host_and_port_and_the_flag_wins():
    env_port, flag_port = free_port(), free_port()
    daemon = Daemon(["--port", str(flag_port)],
                    {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(env_port),
                     "PD_PROXY_RESIDENCY_TIMEOUT_SECONDS": "0.25"})
    try:
        assert daemon.wait_listening() == flag_port
        reply = await request(flag_port, "GET", "/health")
        assert reply.status == 200 and reply.json() == {"status": "ok"}
    finally:
        assert daemon.stop() == 0


async def test_daemon_log_level_is_honoured():
    import asyncio
    import time

    port = free_port()
    daemon = Daemon([], {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": str(port),
                         "PD_PROXY_LOG_LEVEL": "ERROR"})
    try:
        deadline = time.monotonic() + 15
        while True:  # no "listening on" line at this level: poll the port
            try:
                reply = await request(port, "GET", "/healthz")
                break
            except OSError:
                assert daemon.proc.poll() is None, daemon.output()
                assert time.monotonic() < deadline, "daemon did not start"
                await asyncio.sleep(0.05)
        assert reply.status == 200
        # A proxied request with no decode would log a warning at level info/warning.
        assert (await request(port, "GET", "/v1/models")).status == 503
    finally:
        assert daemon.stop() == 0
    output = daemon.output()
    assert "listening on" not in output and "WARNING" not in output and "INFO" not in output
