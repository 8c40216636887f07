"""``lowproxy --demo``: every handshake, and the demo backends' own options."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import subprocess
import sys

import pytest

from helpers import CHAT, Daemon, chat, request

BASE = {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0", "PD_PROXY_LOOP": "asyncio"}
GENERATE = "/inference/v1/generate"
TOKENS = {"model": "demo-model", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}


async def _started(args: list[str], env: dict[str, str] | None = None) -> tuple[Daemon, int]:
    daemon = Daemon(["--demo", *args], {**BASE, **(env or {})})
    return daemon, await asyncio.to_thread(daemon.wait_listening)


def _prefill_ok(page: bytes, handshake: str) -> float:
    pattern = (rf'^lowproxy_prefill_legs_total\{{handshake="{handshake}",outcome="ok"'
               rf'(?:,reason="")?\}} (\S+)$')
    return sum(float(v) for v in re.findall(pattern, page.decode(), re.M))


@pytest.mark.parametrize("handshake", ["relay", "mooncake", "sglang"])
async def test_the_demo_serves_every_handshake_with_a_prefill_leg(handshake):
    daemon, port = await _started([], {"PD_PROXY_KV_PROTOCOL": handshake})
    try:
        reply = await request(port, "POST", CHAT, chat())
        assert reply.status == 200, reply.body
        assert reply.json()["choices"][0]["message"]["content"]
        page = (await request(port, "GET", "/metrics")).body
        assert _prefill_ok(page, handshake) == 1, page.decode()
        if handshake == "sglang":  # the demo decode is SGLang-strict: rooms on every leg
            both = {"model": "demo-model", "prompt": ["a", "b"], "max_tokens": 2}
            assert (await request(port, "POST", "/v1/completions", both)).status == 200
            page = (await request(port, "GET", "/metrics")).body
            assert _prefill_ok(page, handshake) == 2, page.decode()
    finally:
        assert await asyncio.to_thread(daemon.stop) == 0


async def test_demo_args_reach_the_demo_backends():
    daemon, port = await _started([])
    try:  # vLLM without --enable-scale-out: 403, relayed from decode
        assert (await request(port, "POST", GENERATE, TOKENS)).status == 403
    finally:
        assert await asyncio.to_thread(daemon.stop) == 0
    daemon, port = await _started(["--demo-args=--enable-scale-out"])
    try:
        reply = await request(port, "POST", GENERATE, TOKENS)
        assert reply.status == 200, reply.body
        assert reply.json()["choices"][0]["token_ids"]
    finally:
        assert await asyncio.to_thread(daemon.stop) == 0


@pytest.mark.parametrize("args, env, setting, named", [
    (["--demo", "--demo-args", "--no-such-option 1"], {}, "--demo-args", "--no-such-option"),
    (["--demo"], {"PD_PROXY_DEMO_ARGS": "--role decode"}, "PD_PROXY_DEMO_ARGS", "--role"),
    ([], {"PD_PROXY_DEMO_ARGS": "--enable-scale-out"}, "PD_PROXY_DEMO_ARGS", "not --demo"),
])
def test_demo_args_mistakes_stop_the_start(args, env, setting, named):
    daemon = Daemon(args, {**BASE, **env})
    assert daemon.proc.wait(30) == 2
    [line] = [line for line in daemon.output().splitlines() if line.strip()]
    assert line.startswith(f"lowproxy: {setting}") and named in line


def test_the_readme_demo_command_binds_loopback():
    from test_readme import README

    [command] = [line for line in README.splitlines() if "lowproxy --demo" in line
                 and line.startswith("python3 -m venv")]
    assert "--host 127.0.0.1" in command
    assert "--host 0.0.0.0" in README  # and says how to open it up


def test_the_demo_backends_key_is_not_in_the_config_repr():
    from lowproxy.config.settings import load_config

    config, _ = load_config(["--demo", "--demo-args=--api-key demo-secret-1"], {})
    assert config.demo_args == ("--api-key", "demo-secret-1")
    assert "demo-secret-1" not in repr(config)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a non-interactive shell's `&` does


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_the_demo_backends_stop_on_a_signal_even_with_sigint_ignored_at_start(number):
    """``python -m lowproxy.demo`` started from a background job inherits SIGINT
    ignored (and Python then installs no KeyboardInterrupt); it handles SIGINT and
    SIGTERM itself, so bench/load.py's stop is not waited out for 10 s."""
    demo = subprocess.Popen([sys.executable, "-m", "lowproxy.demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, preexec_fn=_ignore_sigint)
    try:
        assert demo.stdout is not None
        assert "decode" in json.loads(demo.stdout.readline())
        demo.send_signal(number)
        assert demo.wait(5) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        if demo.stdout is not None:
            demo.stdout.close()


async def test_a_demo_backend_advertises_the_address_it_listens_on():
    """Its URL and the KV side channel it names to decode (remote_host) were always
    127.0.0.1: a decode in another process on another address could not pull. A
    wildcard is no address to give, so it stays loopback there."""
    from lowproxy.demo import DemoBackend

    for host, advertised in (("127.0.0.2", "127.0.0.2"), ("0.0.0.0", "127.0.0.1")):
        backend = DemoBackend("prefill")
        try:
            await backend.start(host, 0)
        except OSError:
            pytest.skip("no 127.0.0.2 on this machine")
        try:
            assert backend.url == f"http://{advertised}:{backend.port}"

            def post(advertised: str = advertised, port: int = backend.port) -> dict:
                connection = http.client.HTTPConnection(advertised, port, timeout=10)
                try:
                    connection.request("POST", "/v1/completions", json.dumps({
                        "model": "demo-model", "prompt": "p", "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True}}),
                        {"content-type": "application/json"})
                    return json.loads(connection.getresponse().read())
                finally:
                    connection.close()
            answer = await asyncio.to_thread(post)
            assert answer["kv_transfer_params"]["remote_host"] == advertised
        finally:
            await backend.close()


def test_nixl_block_ids_are_nested_as_vllm_0_33_sends_them_unless_flat_is_asked():
    from lowproxy.demo.options import pair_options

    assert pair_options([])["nested_block_ids"] is True
    assert pair_options(["--nested-block-ids"])["nested_block_ids"] is True
    assert pair_options(["--flat-block-ids"])["nested_block_ids"] is False
