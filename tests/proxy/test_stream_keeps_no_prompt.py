"""A stream that lasts minutes holds no copy of its request's prompt (issue 21).

Routing (cache-aware, the default) renders the prompt and keeps the client's body
beside the prefix hashes for its choice; once the choice is made neither may live
as long as the stream. Over real sockets: the demo backends in a process of their
own (so that the only parsed copies of the prompt are the proxy's), the proxy in
this one, a stream left open while the heap is searched for the prompt's message.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys

import pytest

from helpers import config_for, running_proxy
from helpers.client import Client

MARKER = "a prompt nobody else holds " + "x" * 3000


def _prompt_dicts() -> list[list]:
    """Message lists holding the prompt (a dict of strings alone is not tracked by the
    collector, the list of messages holding it is)."""
    gc.collect()
    return [o for o in gc.get_objects()
            if type(o) is list and any(type(m) is dict and m.get("content") == MARKER
                                       for m in o)]


@pytest.mark.parametrize("kv_protocol", ["relay", "mooncake"])
async def test_an_open_stream_keeps_no_parsed_prompt(kv_protocol):
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lowproxy.demo", "--stream-chunks", "200", "--chunk-delay", "0.05",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert demo.stdout is not None
        info = json.loads(await demo.stdout.readline())
        prefill = f"{info['prefill']}#bootstrap_port={info['bootstrap_port']}"
        config = config_for(prefill, info["decode"], kv_protocol=kv_protocol,
                            prefill_policy="cache-aware",
                            mooncake_bootstrap_port=info["bootstrap_port"])
        async with running_proxy(config) as proxy:
            client = await Client.open(proxy.port)
            try:
                client.send("POST", "/v1/chat/completions", raw_body=json.dumps({
                    "model": "demo-model", "stream": True, "max_tokens": 200,
                    "messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": MARKER}]}).encode())
                streamed = await client.read_until(b"data: ", timeout=10)
                assert streamed.status == 200
                assert _prompt_dicts() == []  # the stream runs on; the prompt is gone
                assert proxy.proxy.router is not None  # cache-aware routed it
            finally:
                client.close()
    finally:
        demo.terminate()
        await demo.wait()
