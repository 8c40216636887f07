"""Issue 6: metrics, logs, trace context and readiness, as an operator sees them."""

from __future__ import annotations

import asyncio
import json
import signal

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from helpers import Daemon, chat, config_for, free_port, pd_setup, request, running_proxy
from lowproxy.demo import start_pair

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

_exporter = InMemorySpanExporter()
if not isinstance(trace.get_tracer_provider(), TracerProvider):
    _provider = TracerProvider()
    _provider.add_span_processor(SimpleSpanProcessor(_exporter))
    trace.set_tracer_provider(_provider)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by name and sorted labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(page: dict, name: str, **labels: str) -> float:
    return page.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(port: int) -> dict:
    reply = await request(port, "GET", "/metrics")
    assert reply.status == 200
    assert reply.header("content-type").startswith(b"text/plain; version=0.0.4")
    return samples(reply.body.decode())


async def test_metrics_follow_a_known_sequence_of_requests():
    async with pd_setup() as (proxy, prefill, decode):
        before = await scrape(proxy.port)
        assert value(before, "lowproxy_requests_total", route="generation", status="200") == 0

        # 1. success
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
        # 2. fallback: prefill fails, decode recomputes
        prefill.faults.status = 500
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
        prefill.faults.status = None
        # 3. a client that leaves mid-stream
        decode.chunk_delay = 0.05
        decode.stream_chunks = 200
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body = json.dumps(chat(stream=True)).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await reader.readuntil(b"data: ")
        writer.close()
        for _ in range(100):
            if decode.aborted_streams:
                break
            await asyncio.sleep(0.02)
        decode.chunk_delay = 0.0
        decode.stream_chunks = None
        # 4. decode down
        await decode.close()
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 503

        page = await scrape(proxy.port)
        assert value(page, "lowproxy_requests_total", route="generation", status="200") == 3
        assert value(page, "lowproxy_requests_total", route="generation", status="503") == 1
        assert value(page, "lowproxy_prefill_legs_total", handshake="relay", outcome="ok") == 3
        assert value(page, "lowproxy_prefill_legs_total", handshake="relay",
                     outcome="error") == 1
        assert value(page, "lowproxy_prefill_legs_total", handshake="relay",
                     outcome="recompute") == 1
        assert value(page, "lowproxy_decode_legs_total", outcome="ok") == 2
        assert value(page, "lowproxy_decode_legs_total", outcome="client-gone") == 1
        assert value(page, "lowproxy_decode_legs_total", outcome="unreachable") == 1
        assert value(page, "lowproxy_endpoints_in_cooldown", role="decode") == 1
        assert value(page, "lowproxy_requests_in_flight") == 0
        assert value(page, "lowproxy_asyncio_tasks") >= 1
        assert value(page, "process_open_fds") > 0
        assert value(page, "process_resident_memory_bytes") > 0
        assert value(page, "lowproxy_requests_total", route="metrics", status="200") >= 1


async def test_histogram_buckets_are_cumulative_and_match_count():
    async with pd_setup() as (proxy, prefill, decode):
        for _ in range(5):
            assert (await proxy.request("POST", "/v1/completions",
                                        {"model": "m", "prompt": "hi"})).status == 200
        page = await scrape(proxy.port)
    for name, labels in (("lowproxy_request_duration_seconds", {"route": "generation"}),
                         ("lowproxy_prefill_duration_seconds", {"handshake": "relay"}),
                         ("lowproxy_decode_first_byte_seconds", {})):
        buckets = sorted(
            ((float(dict(key[1])["le"]), count) for key, count in page.items()
             if key[0] == name + "_bucket"
             and {k: v for k, v in key[1] if k != "le"} == labels),
            key=lambda item: item[0])
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), f"{name} buckets not cumulative"
        assert buckets[-1][0] == float("inf")
        assert buckets[-1][1] == value(page, name + "_count", **labels) == 5
        assert value(page, name + "_sum", **labels) > 0


async def test_gauges_describe_pools_and_bootstrap_cache():
    async with pd_setup("mooncake") as (proxy, prefill, decode):
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
        page = await scrape(proxy.port)
        assert value(page, "lowproxy_bootstrap_cache_entries") == 1
        assert value(page, "lowproxy_bootstrap_query_duration_seconds_count",
                     outcome="ok") == 1
        assert value(page, "lowproxy_upstream_connections", role="decode",
                     endpoint=decode.url, state="idle") == 1
        assert value(page, "lowproxy_client_connections") >= 1


async def test_traceparent_reaches_both_legs():
    async with pd_setup() as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=[("traceparent", TRACEPARENT),
                                             ("tracestate", "vendor=1")])
        assert reply.status == 200
        for backend in (prefill, decode):
            [leg] = backend.requests_to("/chat/completions")
            assert leg.header("traceparent") == TRACEPARENT.encode()
            assert leg.header("tracestate") == b"vendor=1"


async def test_trace_id_started_when_asked_and_absent():
    async with pd_setup(trace=True) as (proxy, prefill, decode):
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
        [pf] = prefill.requests_to("/chat/completions")
        [dc] = decode.requests_to("/chat/completions")
        parent = pf.header("traceparent")
        assert parent is not None and parent == dc.header("traceparent")
        version, trace_id, span_id, flags = parent.split(b"-")
        assert version == b"00" and len(trace_id) == 32 and len(span_id) == 16
    async with pd_setup() as (proxy, prefill, decode):
        assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
        assert decode.requests_to("/chat/completions")[0].header("traceparent") is None


async def test_opentelemetry_spans_carry_llm_d_attributes():
    _exporter.clear()
    async with pd_setup("mooncake", otel=True) as (proxy, prefill, decode):
        reply = await proxy.request("POST", "/v1/chat/completions", chat(),
                                    headers=[("traceparent", TRACEPARENT)])
        assert reply.status == 200
        for _ in range(50):
            if len(_exporter.get_finished_spans()) >= 3:
                break
            await asyncio.sleep(0.02)
        [dc] = decode.requests_to("/chat/completions")
    spans = {span.name: span for span in _exporter.get_finished_spans()}
    server = spans["POST /v1/chat/completions"]
    prefill_span = spans["llm_d.pd_proxy.prefill"]
    decode_span = spans["llm_d.pd_proxy.decode"]
    trace_id = int(TRACEPARENT.split("-")[1], 16)
    assert {server.context.trace_id, prefill_span.context.trace_id,
            decode_span.context.trace_id} == {trace_id}
    assert prefill_span.parent.span_id == decode_span.parent.span_id == server.context.span_id
    assert prefill_span.attributes["llm_d.pd_proxy.connector"] == "mooncake"
    assert prefill_span.attributes["llm_d.pd_proxy.prefill.status_code"] == 200
    assert prefill_span.attributes["llm_d.pd_proxy.prefill.duration_ms"] >= 0
    assert server.attributes["llm_d.pd_proxy.true_ttft_ms"] >= 0
    assert server.attributes["llm_d.pd_proxy.total_duration_ms"] >= \
        server.attributes["llm_d.pd_proxy.true_ttft_ms"]
    assert server.attributes["llm_d.pd_proxy.concurrent_pd"] is True
    # The backends' spans nest under the proxy's server span.
    assert dc.header("traceparent").split(b"-")[2] == \
        format(server.context.span_id, "016x").encode()


async def test_readiness_flips_when_decode_goes_down_and_back():
    prefill, decode = await start_pair()
    port = decode.port
    try:
        async with running_proxy(config_for(prefill.url, decode.url)) as proxy:
            assert (await proxy.request("GET", "/readyz")).status == 200
            await decode.close()
            assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 503
            reply = await proxy.request("GET", "/readyz")
            assert reply.status == 503
            assert reply.json()["reason"] == "no usable decode endpoint"
            assert (await proxy.request("GET", "/healthz")).status == 200  # liveness stays
            await decode.start(port=port, bootstrap_port=None)
            for _ in range(100):  # the cooldown runs out
                if (await proxy.request("GET", "/readyz")).status == 200:
                    break
                await asyncio.sleep(0.1)
            assert (await proxy.request("GET", "/readyz")).status == 200
            assert (await proxy.request("POST", "/v1/chat/completions", chat())).status == 200
    finally:
        await prefill.close()
        await decode.close()


async def test_readiness_without_decode_configured():
    async with running_proxy(config_for()) as proxy:
        reply = await proxy.request("GET", "/readyz")
        assert reply.status == 503
        assert reply.json() == {"status": "unavailable",
                                "reason": "no decode endpoint configured"}


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def test_json_logs_parse_carry_request_id_and_no_secret():
    prefill, decode = await start_pair()
    secret = "sk-very-secret-token"
    admin_key = "admin-key-do-not-log"
    prompt = "confidential prompt text"
    metrics_port = free_port()
    daemon = Daemon(["--port", "0", "--host", "127.0.0.1"], env={
        "PD_PROXY_PREFILL_URL": prefill.url, "PD_PROXY_DECODE_URL": decode.url,
        "PD_PROXY_LOG_FORMAT": "json", "ADMIN_API_KEY": admin_key,
        "PD_PROXY_METRICS_PORT": str(metrics_port), "PD_PROXY_LOOP": "asyncio"})
    try:
        port = await asyncio.to_thread(daemon.wait_listening)
        reply = await request(port, "POST", "/v1/chat/completions",
                              chat(messages=[{"role": "user", "content": prompt}]),
                              headers=[("authorization", f"Bearer {secret}"),
                                       ("x-request-id", "req-42")])
        assert reply.status == 200
        assert (await request(port, "POST", "/instances/add", {},
                              headers=[("x-admin-api-key", admin_key)])).status == 200
        assert (await request(port, "POST", "/instances/add", {},
                              headers=[("authorization", f"Bearer {secret}")])).status == 403
        prefill.faults.status = 500  # a warning with the request id
        assert (await request(port, "POST", "/v1/chat/completions", chat(),
                              headers=[("x-request-id", "req-43")])).status == 200
        metrics = await request(metrics_port, "GET", "/metrics")
        assert metrics.status == 200 and b"lowproxy_requests_total" in metrics.body
        assert (await request(metrics_port, "GET", "/v1/models")).status == 404
    finally:
        assert await asyncio.to_thread(daemon.stop, signal.SIGTERM) == 0
        await prefill.close()
        await decode.close()
    output = daemon.output()
    lines = _json_lines(output)
    assert lines, output
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line)
    access = [line for line in lines if line["logger"] == "lowproxy.access"]
    first = next(line for line in access if line.get("request_id") == "req-42")
    assert first["status"] == 200 and first["path"] == "/v1/chat/completions"
    assert isinstance(first["total_ms"], float) and isinstance(first["bytes_out"], int)
    assert first["handshake"] == "relay" and first["backend"] == decode.url
    for key in ("prefill_ms", "decode_first_byte_ms", "total_ms", "bytes_out", "trace_id"):
        assert key in first
    warnings = [line for line in lines if line["level"] == "warning"]
    assert any(line.get("request_id") == "req-43" and "prefill" in line["message"]
               for line in warnings), warnings
    for needle in (secret, admin_key, prompt):
        assert needle not in output


async def test_readiness_503_during_drain_while_a_stream_finishes():
    from helpers import exchange

    prefill, decode = await start_pair(stream_chunks=30, chunk_delay=0.03)
    try:
        async with running_proxy(config_for(prefill.url, decode.url)) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            assert (await exchange(reader, writer, "GET", "/readyz")).status == 200
            streaming = asyncio.ensure_future(
                proxy.request("POST", "/v1/completions",
                              {"model": "m", "prompt": "hi", "stream": True}))
            for _ in range(200):
                if decode.open_streams:
                    break
                await asyncio.sleep(0.01)
            proxy.proxy.draining = True
            draining = asyncio.ensure_future(proxy.server.drain(10))
            await asyncio.sleep(0)
            probe = await exchange(reader, writer, "GET", "/readyz")
            assert probe.status == 503 and probe.json()["reason"] == "draining"
            assert probe.header("connection") == b"close"
            streamed = await streaming
            assert streamed.status == 200 and streamed.complete
            assert streamed.body.endswith(b"data: [DONE]\n\n")
            await asyncio.wait_for(draining, 5)
            writer.close()
    finally:
        await prefill.close()
        await decode.close()
