"""HTTPS towards clients on each event loop the daemon runs: keep-alive, a long
stream to a slow reader, and no handler error in the log.

Under uvloop, ``connect_accepted_socket`` returns uvloop's internal SSL protocol
rather than the application's StreamReaderProtocol; a StreamWriter built on it
failed every drain (the second request of a connection was refused, a stream cut
short while the access line said 200). The daemon is run on asyncio and on
uvloop, with its demo backends.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time

import pytest
import trustme
from test_client_tls import client_context, write_pair

from helpers import Daemon

CHUNKS = 20000  # streamed tokens: megabytes of SSE, more than the socket buffers hold


def keep_alive_and_slow_stream(port: int, context) -> tuple[list[int], bytes]:
    connection = http.client.HTTPSConnection("localhost", port, context=context, timeout=30)
    try:
        statuses = []
        for _ in range(3):  # one connection, three answers
            connection.request("GET", "/healthz")
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "hi"}]})
        connection.request("POST", "/v1/chat/completions", body,
                           {"content-type": "application/json"})
        response = connection.getresponse()
        statuses.append(response.status)
        streamed = bytearray()
        while True:  # a slow reader: the proxy's writes wait on drain
            piece = response.read(65536)
            if not piece:
                break
            streamed += piece
            time.sleep(0.002)
        return statuses, bytes(streamed)
    finally:
        connection.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_https_keep_alive_and_a_slow_stream_on_each_loop(tmp_path, loop):
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is optional (lowproxy[fast])")
    ca = trustme.CA()
    cert_file, key_file = write_pair(tmp_path, ca.issue_cert("localhost"))
    daemon = Daemon(["--demo", f"--demo-args=--stream-chunks {CHUNKS}"],
                    {"PD_PROXY_HOST": "127.0.0.1", "PD_PROXY_PORT": "0", "PD_PROXY_LOOP": loop,
                     "PD_PROXY_TLS_CERT_FILE": cert_file, "PD_PROXY_TLS_KEY_FILE": key_file})
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        statuses, streamed = await asyncio.to_thread(keep_alive_and_slow_stream, port,
                                                   client_context(ca))
        assert statuses == [200, 200, 200, 200]
        assert streamed.endswith(b"data: [DONE]\n\n")
        assert streamed.count(b"\ndata: {") >= CHUNKS - 1
    finally:
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0, daemon.output()
    output = daemon.output()
    assert "handler failed" not in output and "never retrieved" not in output, output
