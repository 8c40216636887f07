"""An emulated vLLM OpenAI server: prefill, decode and Mooncake bootstrap in one.

It serves ``--demo`` (a newcomer's first curl works with no GPU), the test
suite and bench/load.py. It is strict where vLLM is strict, so tests catch a
proxy that shapes legs wrongly:

* ``stream_options`` without ``stream`` and ``min_tokens > max_tokens`` are 400s;
* a relay (NIXL-style) decode given ``do_remote_prefill`` without
  ``remote_block_ids`` fails (NIXL asserts);
* a Mooncake decode waits for the prefill of its ``transfer_id`` on the engine
  it was told, for ``kv_wait_timeout`` seconds (vLLM 0.30+ then fails the
  request) or for ever when that is None (vLLM 0.16-0.28);
* an SGLang decode waits likewise for the prefill of its ``bootstrap_room``.

Every request it receives is recorded in ``received`` (method, path, headers,
parsed body), and a few knobs inject faults. Prefill and decode started in one
process share a KvRegistry, which stands in for the KV transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .answers import json_body
from .messages import AbortResponse, ClientRequest
from .responder import Responder
from .server import HttpServer

MODEL = "demo-model"


class KvRegistry:
    """Which transfers a prefill has computed, standing in for the KV transfer."""

    def __init__(self) -> None:
        self._ready: dict[str, asyncio.Future[str]] = {}

    def _future(self, key: str) -> asyncio.Future[str]:
        future = self._ready.get(key)
        if future is None:
            future = self._ready[key] = asyncio.get_running_loop().create_future()
        return future

    def computed(self, key: str, engine_id: str) -> None:
        future = self._future(key)
        if not future.done():
            future.set_result(engine_id)

    def is_computed(self, key: str) -> bool:
        future = self._ready.get(key)
        return future is not None and future.done()

    def take(self, key: str) -> bool:
        """Whether the KV of ``key`` was computed; a decode pulls it once, so forget it
        (a long benchmark or --demo run would otherwise keep every key)."""
        future = self._ready.get(key)
        if future is None or not future.done():
            return False
        del self._ready[key]
        return True

    async def wait(self, key: str, timeout: float | None) -> str:
        future = self._future(key)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            if future.done():
                self._ready.pop(key, None)


@dataclass
class Received:
    method: str
    path: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: Any
    raw_body: bytes

    def header(self, name: str) -> bytes | None:
        key = name.lower().encode()
        for header, value in self.headers:
            if header == key:
                return value
        return None


@dataclass
class Faults:
    """Knobs a test turns to make this backend misbehave."""

    status: int | None = None          # answer generation requests with this status
    delay: float = 0.0                 # wait this long before answering
    hang: bool = False                 # accept, read, never answer
    die_after_chunks: int | None = None  # stream this many chunks, then drop the connection
    close_without_response: bool = False
    kv_params: Any = "default"         # prefill's kv_transfer_params answer ("default": NIXL-like)
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class DemoBackend:
    def __init__(self, role: str = "decode", *, ranks: int = 1,
                 registry: KvRegistry | None = None,
                 stream_chunks: int | None = None, chunk_delay: float = 0.0,
                 kv_wait_timeout: float | None = 30.0, record: bool = True) -> None:
        self.role = role  # "prefill" or "decode": only SGLang needs to know
        name = role
        self.name = name
        self.registry = registry or KvRegistry()
        self.engine_ids = {str(rank): f"{name}-{uuid.uuid4().hex[:12]}_dp{rank}"
                           for rank in range(ranks)}
        self.stream_chunks = stream_chunks
        self.chunk_delay = chunk_delay
        self.kv_wait_timeout = kv_wait_timeout
        self.record = record
        self.faults = Faults()
        self.received: list[Received] = []
        self.bootstrap_queries = 0
        self.bootstrap_up = True
        self.open_streams = 0
        self.aborted_streams = 0
        # Generation requests whose caller hung up before the answer ended (vLLM
        # aborts such a request): how tests see that the proxy closed a leg.
        self.abandoned = 0
        self.server = HttpServer(self.handle)
        self.bootstrap_server = HttpServer(self.handle_bootstrap)
        self.port = 0
        self.bootstrap_port = 0

    # -- life cycle

    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    bootstrap_port: int | None = 0) -> "DemoBackend":
        await self.server.listen(host, port)
        self.port = self.server.ports[0]
        if bootstrap_port is not None:
            await self.bootstrap_server.listen(host, bootstrap_port)
            self.bootstrap_port = self.bootstrap_server.ports[0]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        await self.server.drain(0)
        await self.bootstrap_server.drain(0)

    def restart_engines(self) -> None:
        """New engine ids, as a restarted vLLM prefill would have."""
        self.engine_ids = {rank: f"{self.name}-{uuid.uuid4().hex[:12]}_dp{rank}"
                           for rank in self.engine_ids}

    def requests_to(self, suffix: str) -> list[Received]:
        return [r for r in self.received if r.path.endswith(suffix)]

    # -- the bootstrap server (GET /query)

    async def handle_bootstrap(self, request: ClientRequest, responder: Responder) -> None:
        if request.path != "/query" or not self.bootstrap_up:
            await responder.send_bytes(404, b'{"detail":"Not Found"}')
            return
        self.bootstrap_queries += 1
        answer = {rank: {"engine_id": engine_id,
                         "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{40000 + int(rank)}"}}}
                  for rank, engine_id in self.engine_ids.items()}
        await responder.send_json(200, answer)

    # -- the OpenAI server

    async def handle(self, request: ClientRequest, responder: Responder) -> None:
        path = request.path
        body: Any = None
        if request.body:
            try:
                body = json.loads(request.body)
            except ValueError:
                body = None
        if self.record:
            self.received.append(Received(request.method.decode(), path,
                                          request.target.decode("latin-1"), request.headers,
                                          body, request.body))
        if request.method in (b"GET", b"HEAD"):
            await self._get(path, responder)
            return
        if not path.endswith(("/completions", "/embeddings")):
            await responder.send_json(200, {"path": path, "echo": body})
            return
        faults = self.faults
        if faults.close_without_response:
            responder.drop()
            return
        responder.watch_client()  # a hang-up cancels this handler, as vLLM aborts
        try:
            await self._generation(request, responder, path, body)
        except asyncio.CancelledError:
            if responder.client_gone:
                self.abandoned += 1
            raise

    async def _generation(self, request: ClientRequest, responder: Responder, path: str,
                          body: Any) -> None:
        faults = self.faults
        if faults.hang:
            await asyncio.Event().wait()
        if faults.delay:
            await asyncio.sleep(faults.delay)
        if faults.status is not None:
            await self._error(responder, faults.status, "injected failure", "InternalServerError")
            return
        if not isinstance(body, dict):
            await self._error(responder, 400, "body must be a JSON object", "BadRequestError")
            return
        if path.endswith("/embeddings"):
            await responder.send_json(200, {"object": "list", "model": body.get("model", MODEL),
                                            "data": [{"object": "embedding", "index": 0,
                                                      "embedding": [0.1, 0.2, 0.3]}]})
            return
        problem = _validate(body)
        if problem:
            await self._error(responder, 400, problem, "BadRequestError")
            return
        await self._generate(request, responder, body)

    async def _get(self, path: str, responder: Responder) -> None:
        if path == "/health":
            await responder.send_bytes(200, b"", [])
        elif path == "/version":
            await responder.send_json(200, {"version": "0.0.0-demo"})
        elif path.endswith("/models"):
            await responder.send_json(200, {"object": "list", "data": [{
                "id": MODEL, "object": "model", "created": 0, "owned_by": "lowproxy-demo",
                "root": MODEL, "parent": None, "max_model_len": 4096}]})
        else:
            await responder.send_json(404, {"detail": "Not Found"})

    async def _error(self, responder: Responder, status: int, message: str, kind: str) -> None:
        await responder.send_json(status, {"error": {"message": message, "type": kind,
                                                     "param": None, "code": status}})

    async def _generate(self, request: ClientRequest, responder: Responder,
                        body: dict[str, Any]) -> None:
        kv = body.get("kv_transfer_params")
        kv = kv if isinstance(kv, dict) else {}
        room = body.get("bootstrap_room")
        rank = (request.header(b"x-data-parallel-rank") or b"0").decode()
        engine_id = self.engine_ids.get(rank)
        request_id = (request.header(b"x-request-id") or uuid.uuid4().hex.encode()).decode(
            "latin-1")
        answer_kv: Any = None
        if kv.get("do_remote_decode"):  # a prefill leg (relay or mooncake)
            if engine_id is None:
                await self._error(responder, 400, f"no data parallel rank {rank}",
                                  "BadRequestError")
                return
            transfer_id = kv.get("transfer_id")
            if transfer_id:  # vLLM 0.16+ Mooncake: prefill answers nothing useful
                self.registry.computed(str(transfer_id), engine_id)
            elif self.faults.kv_params == "default":
                remote_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
                self.registry.computed(remote_id, engine_id)
                answer_kv = {"do_remote_prefill": True, "do_remote_decode": False,
                             "remote_block_ids": [1, 2, 3], "remote_engine_id": engine_id,
                             "remote_request_id": remote_id, "remote_host": "127.0.0.1",
                             "remote_port": 5600, "tp_size": 1}
            else:
                answer_kv = self.faults.kv_params
        elif kv.get("do_remote_prefill"):  # a decode leg that pulls KV
            problem = await self._pull_kv(kv)
            if problem:
                await self._error(responder, 500, problem, "InternalServerError")
                return
        elif room is not None and body.get("bootstrap_host"):
            if self.role == "prefill":
                self.registry.computed(f"room-{room}", self.name)
            else:
                try:
                    await self.registry.wait(f"room-{room}", self.kv_wait_timeout)
                except asyncio.TimeoutError:
                    await self._error(responder, 500, "KV transfer timed out",
                                      "InternalServerError")
                    return
        await self._answer(request, responder, body, request_id, answer_kv)

    async def _pull_kv(self, kv: dict[str, Any]) -> str | None:
        """What a decode server does with kv_transfer_params; a problem or None."""
        if "transfer_id" in kv:  # Mooncake 0.16+
            missing = [key for key in ("transfer_id", "remote_engine_id",
                                       "remote_bootstrap_addr") if not kv.get(key)]
            if missing:  # vLLM waits for KV that never comes
                await asyncio.sleep(self.kv_wait_timeout or 3600)
                return f"KV transfer never arrived (missing {', '.join(missing)})"
            try:
                engine = await self.registry.wait(str(kv["transfer_id"]), self.kv_wait_timeout)
            except asyncio.TimeoutError:
                return "KV transfer timed out"
            if engine != kv["remote_engine_id"]:
                return f"KV for {kv['transfer_id']} is on engine {engine}, not " \
                       f"{kv['remote_engine_id']}"
            return None
        if not kv.get("remote_block_ids"):
            return "assertion failed: do_remote_prefill without remote_block_ids"
        remote_id = str(kv.get("remote_request_id"))
        if not self.registry.take(remote_id):
            return f"no prefilled KV for request {remote_id}"
        return None

    async def _answer(self, request: ClientRequest, responder: Responder, body: dict[str, Any],
                      request_id: str, answer_kv: Any) -> None:
        chat = request.path.endswith("/chat/completions")
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        tokens = int(limit) if isinstance(limit, int) and limit > 0 else 16
        model = body.get("model") or MODEL
        created = int(time.time())
        prefix = "chatcmpl-" if chat else "cmpl-"
        response_id = prefix + request_id
        if not body.get("stream"):
            text = "".join(f"tok{i} " for i in range(tokens))
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant",
                                                               "content": text},
                                       "finish_reason": "length"} if chat else
                                      {"index": 0, "text": text, "finish_reason": "length",
                                       "logprobs": None})
            answer = {"id": response_id, "object": "chat.completion" if chat else
                      "text_completion", "created": created, "model": model,
                      "choices": [choice],
                      "usage": {"prompt_tokens": 5, "completion_tokens": tokens,
                                "total_tokens": 5 + tokens},
                      "kv_transfer_params": answer_kv}
            await responder.send_bytes(200, json_body(answer),
                                       [(b"content-type", b"application/json"),
                                        *self.faults.extra_headers])
            return
        count = self.stream_chunks or tokens
        await responder.start(200, [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    *self.faults.extra_headers])
        self.open_streams += 1
        finished = False
        try:
            for i in range(count):
                if self.faults.die_after_chunks is not None and i >= self.faults.die_after_chunks:
                    raise AbortResponse()  # the connection closes without the last chunk
                if chat:
                    delta: dict[str, Any] = {"content": f"tok{i} "}
                    if i == 0:
                        delta["role"] = "assistant"
                    choice = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": "length" if i == count - 1 else None}
                else:
                    choice = {"index": 0, "text": f"tok{i} ", "logprobs": None,
                              "finish_reason": "length" if i == count - 1 else None}
                chunk = {"id": response_id, "object": "chat.completion.chunk" if chat else
                         "text_completion", "created": created, "model": model,
                         "choices": [choice]}
                await responder.write(b"data: " + json_body(chunk) + b"\n\n")
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                usage = {"id": response_id, "object": "chat.completion.chunk" if chat else
                         "text_completion", "created": created, "model": model, "choices": [],
                         "usage": {"prompt_tokens": 5, "completion_tokens": count,
                                   "total_tokens": 5 + count}}
                await responder.write(b"data: " + json_body(usage) + b"\n\n")
            await responder.write(b"data: [DONE]\n\n")
            await responder.end()
            finished = True
        finally:
            self.open_streams -= 1
            if not finished:
                self.aborted_streams += 1


def _validate(body: dict[str, Any]) -> str | None:
    """The vLLM request checks a badly shaped prefill leg trips over."""
    if body.get("stream_options") is not None and not body.get("stream"):
        return "Stream options can only be defined when stream=True."
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    for key in ("min_tokens", "min_completion_tokens"):
        low = body.get(key)
        if isinstance(low, int) and isinstance(max_tokens, int) and low > max_tokens:
            return f"{key} must be less than or equal to max_tokens={max_tokens}, got {low}."
    if "messages" not in body and "prompt" not in body:
        return "either prompt or messages is required"
    return None


async def start_pair(host: str = "127.0.0.1", *, ranks: int = 1, stream_chunks: int | None = None,
                     chunk_delay: float = 0.0, record: bool = True,
                     ports: tuple[int, int] = (0, 0)) -> tuple[DemoBackend, DemoBackend]:
    """A prefill and a decode backend sharing one KV registry."""
    registry = KvRegistry()
    prefill = DemoBackend("prefill", ranks=ranks, registry=registry, record=record)
    decode = DemoBackend("decode", registry=registry, stream_chunks=stream_chunks,
                         chunk_delay=chunk_delay, record=record)
    await prefill.start(host, ports[0], bootstrap_port=0)
    await decode.start(host, ports[1], bootstrap_port=None)
    return prefill, decode


def main(argv: list[str] | None = None) -> None:
    """``python -m lowproxy.demo``: a prefill and a decode emulator, for benchmarks."""
    parser = argparse.ArgumentParser(prog="python -m lowproxy.demo")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--prefill-port", type=int, default=0)
    parser.add_argument("--decode-port", type=int, default=0)
    parser.add_argument("--stream-chunks", type=int, default=None)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    args = parser.parse_args(argv)

    async def run() -> None:
        prefill, decode = await start_pair(args.host, stream_chunks=args.stream_chunks,
                                           chunk_delay=args.chunk_delay, record=False,
                                           ports=(args.prefill_port, args.decode_port))
        print(json.dumps({"prefill": prefill.url, "decode": decode.url,
                          "bootstrap_port": prefill.bootstrap_port}), flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
