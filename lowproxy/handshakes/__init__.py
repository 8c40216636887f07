"""The KV handshakes: how a generation request is split between prefill and decode.

legs.py shapes bodies (pure); relay.py, mooncake.py and sglang.py run the
legs; each handshake module exposes ``run(proxy, exchange, body, prefill)``.
"""
