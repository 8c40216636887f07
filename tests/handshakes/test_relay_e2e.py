"""The relay handshake end to end: bodies and headers as the backends receive them."""

from __future__ import annotations

from helpers import chat, pd_setup


async def test_relay_prefill_then_decode_with_kv_relayed():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions",
                                    chat(stream=True, stream_options={"include_usage": True},
                                         min_tokens=2,
                                         max_completion_tokens=5,
                                         kv_transfer_params={"remote_host": "evil"}))
        assert reply.status == 200, reply.body
        [pf] = prefill.requests_to("/chat/completions")
        [dc] = decode.requests_to("/chat/completions")
        assert pf.body["stream"] is False and pf.body["max_tokens"] == 1
        assert pf.body["max_completion_tokens"] == 1 and pf.body["ignore_eos"] is True
        assert "stream_options" not in pf.body and "min_tokens" not in pf.body
        assert pf.body["kv_transfer_params"] == {"do_remote_decode": True,
                                                 "do_remote_prefill": False}
        kv = dc.body["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_block_ids"] == [[1, 2, 3]] and "remote_host" in kv
        assert kv["remote_host"] == "127.0.0.1"
        assert dc.body["stream_options"] == {"include_usage": True}
        assert dc.body["min_tokens"] == 2 and dc.body["max_completion_tokens"] == 5
        assert pf.header("x-request-id") == dc.header("x-request-id") is not None
