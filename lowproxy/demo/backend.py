"""An emulated vLLM OpenAI server (and SGLang PD server): prefill, decode and
Mooncake bootstrap in one.

It serves ``--demo`` (a first curl works with no GPU), the tests and bench/load.py,
strict where vLLM 0.33 is strict, so tests catch a proxy that shapes legs wrongly;
see engine.py (what is accepted, what is generated), handshake.py (what a prefill
keeps and a decode pulls), answers.py (answers) and kv.py (tokens, prefix cache).

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages``, ``/inference/v1/generate`` (with ``scale_out`` only, else
403), ``/v1/embeddings``; ``GET /health``, ``/version``, ``/v1/models``;
SGLang's ``POST /abort_request``. Any other POST is echoed back.

Every request it receives is recorded in ``received`` (method, path, headers,
parsed body), and ``Faults`` knobs inject failures. Prefill and decode started
in one process share a KvRegistry, which stands in for the KV transfer.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Any, Sequence

from ..answers import json_body
from ..downstream.messages import AbortResponse, ClientRequest
from ..downstream.messages import ResponseWriter as Responder
from ..downstream.server import HttpServer
from ..lax_types import is_true
from .answers import Result, answer, responses_object, stream
from .engine import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    GENERATE,
    MAX_SEQUENCES,
    RESPONSES,
    Parsed,
    Problem,
    check_length,
    generate,
    parse,
    route_of,
)
from .handshake import NIXL, EngineDead, prefill_kv, pull_kv, sglang_kv
from .kv import KvRegistry, PrefixCache, tokenize
from .load import EngineLoad
from .sglang import (
    SGLANG_GENERATE,
    abort,
    batch_size,
    child_rids,
    is_native_generate,
    lacks_room,
    open_path,
    parse_generate,
    refuse_without_room,
    rooms_of,
    send_generate,
)
from .wire import DEAD_MESSAGE, Faults, Inflight, Received, answer_aborted, send_error, serve_kv

__all__ = ["DemoBackend", "Faults", "KvRegistry", "MODEL", "Received", "start_pair"]

MODEL = "demo-model"
ORCA_ROUTES = (CHAT, COMPLETIONS)  # vLLM 0.33 reports load on their answers only

class DemoBackend:
    def __init__(self, role: str = "decode", *, ranks: int = 1,
                 registry: KvRegistry | None = None,
                 stream_chunks: int | None = None, chunk_delay: float = 0.0,
                 kv_wait_timeout: float | None = 30.0, record: bool = True,
                 api_key: str | None = None, served_model_names: Sequence[str] | None = None,
                 max_model_len: int = 4096, prompt_tokens_details: bool = False,
                 scale_out: bool = False, relay_connector: str = NIXL,
                 nested_block_ids: bool = True, eos_first: float = 0.0,
                 block_size: int = 16, prefix_cache_blocks: int = 4096,
                 remote_kv: bool = False, seed: int = 0, sglang_pd: bool = False,
                 prefill_us_per_token: float = 0.0) -> None:
        self.role = role  # "prefill" or "decode": only SGLang needs to know
        # An SGLang server started with --disaggregation-mode (demo/sglang.py):
        # its decode refuses a request without bootstrap_room, --api-key guards
        # every path, and its native /generate is served.
        self.sglang_pd = sglang_pd
        self.name = role
        self.registry = registry or KvRegistry()
        self.engine_ids = {str(rank): f"{role}-{uuid.uuid4().hex[:12]}_dp{rank}"
                           for rank in range(ranks)}
        self.stream_chunks = stream_chunks  # streams this many tokens, whatever the cap
        self.chunk_delay = chunk_delay
        self.kv_wait_timeout = kv_wait_timeout
        self.record = record
        self.api_key = api_key  # vLLM --api-key: /v1/... needs "Bearer <key>"
        # None: /v1/models lists demo-model and any model name is answered (the
        # demo's lenient default, which --demo and older tests rely on); given:
        # vLLM's --served-model-name, other names 404.
        self.served_model_names = list(served_model_names or [MODEL])
        self.any_model = served_model_names is None or sglang_pd  # SGLang checks no name
        self.max_model_len = max_model_len
        self.prompt_tokens_details = prompt_tokens_details  # --enable-prompt-tokens-details
        self.scale_out = scale_out  # --enable-scale-out: /inference/v1/generate
        self.relay_connector = relay_connector  # "nixl" or "mooncake-0.13"
        self.nested_block_ids = nested_block_ids  # NIXL 0.33: one list per KV-cache group
        self.eos_first = eos_first  # fraction of requests whose first token is EOS
        self.prefix_cache = PrefixCache(block_size, prefix_cache_blocks)
        # Prefill time per uncached token, the queue, /metrics and ORCA reports.
        self.load = EngineLoad(prefill_us_per_token, block_size * max(1, prefix_cache_blocks))
        self.remote_kv = remote_kv  # separate processes: pull through the bootstrap server
        self._rng = random.Random(seed)
        self.faults = Faults()
        self.received: list[Received] = []
        self.bootstrap_queries = 0
        self.bootstrap_up = True
        self.open_streams = 0
        self.aborted_streams = 0
        self.abandoned = 0  # callers that hung up before the answer ended (vLLM aborts)
        self.kv_copies: list[int] = []      # per prefill leg: engine requests (n x prompts)
        self.kv_dropped: list[str] = []     # transfers freed because prefill stopped
        self.kv_pulls: list[dict[str, Any]] = []  # decode pulls (always prompt 0)
        self.shared_kv_subrequests = 0      # sub-requests that shared prompt 0's params
        self.stuck_pulls = 0                # Mooncake decodes waiting for ever
        self.tokenization_skipped = 0       # decodes given prompt_token_ids
        self.abort_requests: list[str] = []  # rids POSTed to /abort_request
        self.aborted: list[str] = []        # rids of requests an abort ended
        self.stored_responses: dict[str, dict[str, Any]] = {}
        self.dead: str | None = None        # why the engine core died
        self._inflight: set[Inflight] = set()
        self.server = HttpServer(self.handle)
        self.bootstrap_server = HttpServer(self.handle_bootstrap)
        self.port = 0
        self.host = "127.0.0.1"  # advertised (URL, KV side channel): never a wildcard
        self.bootstrap_port = 0

    # -- life cycle

    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    bootstrap_port: int | None = 0) -> DemoBackend:
        await self.server.listen(host, port)
        self.port = self.server.ports[0]
        self.host = host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        if bootstrap_port is not None:
            await self.bootstrap_server.listen(host, bootstrap_port)
            self.bootstrap_port = self.bootstrap_server.ports[0]
        return self

    @property
    def url(self) -> str:
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    @property
    def side_port(self) -> int:
        """The NIXL / old Mooncake side channel a decode connects to: here the
        bootstrap server, which serves the emulated transfer (GET /kv)."""
        return self.bootstrap_port or 5600

    async def close(self) -> None:
        await self.server.drain(0)
        await self.bootstrap_server.drain(0)

    def restart_engines(self) -> None:
        """New engine ids, as a restarted vLLM would have (a dead one comes back)."""
        self.engine_ids = {rank: f"{self.name}-{uuid.uuid4().hex[:12]}_dp{rank}"
                           for rank in self.engine_ids}
        self.dead = None

    def die(self, why: str) -> None:
        """The engine core is gone: every request on it fails, /health answers 503."""
        self.dead = why
        current = asyncio.current_task()
        for entry in list(self._inflight):
            if entry.task is not current and not entry.task.done():
                entry.dead = True
                entry.task.cancel()

    def requests_to(self, suffix: str) -> list[Received]:
        return [r for r in self.received if r.path.endswith(suffix)]

    # -- the bootstrap server (GET /query; GET /kv, the emulated transfer)

    async def handle_bootstrap(self, request: ClientRequest, responder: Responder) -> None:
        if request.path == "/kv" and self.bootstrap_up:
            await serve_kv(self.registry, request, responder)
            return
        if request.path != "/query" or not self.bootstrap_up:
            await responder.send_bytes(404, b'{"detail":"Not Found"}')
            return
        self.bootstrap_queries += 1
        answer_map = {rank: {"engine_id": engine_id,
                             "worker_addr": {"0": {"0": f"tcp://{self.host}:{40000 + int(rank)}"}}}
                      for rank, engine_id in self.engine_ids.items()}
        await responder.send_json(200, answer_map)

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
        if not self._authorised(request):
            await responder.send_json(401, {"error": "Unauthorized"})
            return
        if request.method in (b"GET", b"HEAD"):
            await self._get(path, responder)
            return
        if path == "/abort_request":
            await self._abort(body, responder)
            return
        route = route_of(path)
        if route is None and self.sglang_pd and is_native_generate(path):
            route = SGLANG_GENERATE
        if route is None:
            await responder.send_json(200, {"path": path, "echo": body})
            return
        if self.faults.close_without_response:
            responder.drop()
            return
        request.watch_client()  # a hang-up cancels this handler, as vLLM aborts
        try:
            await self._abortable(request, responder, route, body)
        except asyncio.CancelledError:
            if responder.client_gone:
                self.abandoned += 1
            raise

    def _authorised(self, request: ClientRequest) -> bool:
        # vLLM's --api-key guards the /v1 routes only (not /health, /version, ...);
        # SGLang's guards every path but /health* and /metrics, /abort_request too.
        path = request.path
        guarded = (not open_path(path) if self.sglang_pd
                   else path.startswith("/v1") or path == "/abort_request")
        if self.api_key is None or not guarded:
            return True
        return request.header(b"authorization") == f"Bearer {self.api_key}".encode()

    async def _get(self, path: str, responder: Responder) -> None:
        if path == "/health":
            await responder.send_bytes(503 if self.dead else 200, b"", [])
        elif path == "/metrics":
            await responder.send_bytes(200, self.load.metrics_text(self.served_model_names[0]),
                                       [(b"content-type", b"text/plain; version=0.0.4")])
        elif path == "/version":
            await responder.send_json(200, {"version": "0.33.0-demo"})
        elif path.endswith("/models"):
            await responder.send_json(200, {"object": "list", "data": [{
                "id": name, "object": "model", "created": 0, "owned_by": "lowproxy-demo",
                "root": self.served_model_names[0], "parent": None,
                "max_model_len": self.max_model_len} for name in self.served_model_names]})
        elif path.startswith("/v1/responses/"):
            stored = self.stored_responses.get(path[14:])
            if stored is None:  # vLLM's store is this server's memory alone
                await send_error(responder, 404, f"Response with id '{path[14:]}' not found.",
                                 "invalid_request_error")
            else:
                await responder.send_json(200, stored)
        else:
            await responder.send_json(404, {"detail": "Not Found"})

    async def _abort(self, body: Any, responder: Responder) -> None:
        """SGLang's POST /abort_request (sglang.abort); 200 with an empty body."""
        abort(self, body if isinstance(body, dict) else {})
        await responder.send_bytes(200, b"", [])

    async def _abortable(self, request: ClientRequest, responder: Responder, route: str,
                         body: Any) -> None:
        """Run the generation in a task of its own, so an abort (or the engine's
        death) ends it and this handler still answers."""
        rid = body.get("rid") if isinstance(body, dict) else None
        work = asyncio.ensure_future(self._generation(request, responder, route, body))
        entry = Inflight(str(rid) if rid is not None else uuid.uuid4().hex, work)
        batch = batch_size(route, body) if isinstance(body, dict) else None
        # Past the bound the generation answers 400 (engine.bounded): no rids for it.
        entry.pending = set(child_rids(entry.rid, None if (batch or 0) > MAX_SEQUENCES
                                       else batch))
        self._inflight.add(entry)
        try:
            await work
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # Task.cancelling() is 3.11+; on 3.10 any cancellation ends the handler.
            cancelling = getattr(task, "cancelling", None)
            if task is not None and (cancelling is None or cancelling()):
                raise  # this handler itself is cancelled: the client went away
            if entry.aborted:
                await answer_aborted(responder, entry.rid)
            elif entry.dead:
                if responder.started:
                    responder.drop()
                else:
                    await send_error(responder, 500, DEAD_MESSAGE, "EngineDeadError")
            else:
                raise
        finally:
            self._inflight.discard(entry)
            if not work.done():
                work.cancel()

    async def _generation(self, request: ClientRequest, responder: Responder, route: str,
                          body: Any) -> None:
        faults = self.faults
        if faults.hang:
            await asyncio.Event().wait()
        if faults.delay:
            await asyncio.sleep(faults.delay)
        if faults.status is not None:
            await send_error(responder, faults.status, "injected failure", "InternalServerError")
            return
        if self.dead:
            await send_error(responder, 500, DEAD_MESSAGE, "EngineDeadError")
            return
        if not isinstance(body, dict):
            await send_error(responder, 400, "body must be a JSON object", "BadRequestError")
            return
        if route == EMBEDDINGS:
            await responder.send_json(200, {"object": "list", "model": body.get("model", MODEL),
                                            "data": [{"object": "embedding", "index": 0,
                                                      "embedding": [0.1, 0.2, 0.3]}]})
            return
        if self.sglang_pd and self.role == "decode" and lacks_room(body):
            await refuse_without_room(responder, route, str(body.get("rid") or ""),
                                      bool(body.get("stream")))
            return
        if route == GENERATE and not self.scale_out:
            await send_error(responder, 403, "the generate API needs --enable-scale-out",
                              "ForbiddenError")
            return
        self.load.in_flight += 1
        try:
            try:
                parsed = parse_generate(body) if route == SGLANG_GENERATE \
                    else parse(route, body, self.sglang_pd)
                self._check_model(body, parsed)
                result = await self._run(request, parsed, body)
            except Problem as problem:
                await send_error(responder, problem.status, problem.message, problem.kind,
                                  problem.param, route, problem.in_stream and parsed.stream)
                return
            except EngineDead:
                await send_error(responder, 500, DEAD_MESSAGE, "EngineDeadError")
                return
            orca = self.load.orca_header(request.header(b"endpoint-load-metrics-format")) \
                if not result.parsed.stream and route in ORCA_ROUTES else []
            await self._send(responder, result, orca)
        finally:
            self.load.in_flight -= 1

    def _check_model(self, body: dict[str, Any], parsed: Parsed) -> None:
        model = body.get("model")
        if model is not None and model not in self.served_model_names and not self.any_model:
            raise Problem(404, f"The model `{model}` does not exist.", "model", "NotFoundError")
        parsed.model = model or self.served_model_names[0]
        if not isinstance(previous := body.get("previous_response_id"), (str, type(None))):
            raise Problem(400, "previous_response_id must be a string", "previous_response_id")
        if parsed.route == RESPONSES and previous and previous not in self.stored_responses:
            # A prefill server does not hold the decode server's conversations.
            raise Problem(404, f"Response with id '{previous}' not found.",
                          "previous_response_id", "invalid_request_error")

    async def _run(self, request: ClientRequest, parsed: Parsed, body: dict[str, Any]) -> Result:
        """Compute (or pull) the prompt, generate, and account for the KV."""
        kv = body.get("kv_transfer_params")
        # Beam search drops kv_transfer_params entirely (vLLM 0.33): no pull, no hand-off.
        kv = kv if isinstance(kv, dict) and not is_true(body.get("use_beam_search")) else {}
        rank = (request.header(b"x-data-parallel-rank") or b"0").decode()
        request_id = (request.header(b"x-request-id") or uuid.uuid4().hex.encode()).decode(
            "latin-1")
        given = kv.get("prompt_token_ids")
        if isinstance(given, list) and all(isinstance(t, int) for t in given) and given:
            parsed.prompts[0] = list(given)  # tokenize once (vllm#48145): no tokenizer run
            self.tokenization_skipped += 1
        check_length(parsed, self.max_model_len)
        if self.stream_chunks and parsed.stream:
            parsed.sampling.cap = self.stream_chunks
        if kv.get("do_remote_prefill"):  # a decode pulling KV computes no prompt
            cached = self.prefix_cache.lookup(parsed.prompts[0])
            self.load.looked_up(len(parsed.prompts[0]), cached)
        else:
            # Looked up when its turn to compute comes, as vLLM's scheduler does:
            # a request queued behind one with the same prefix hits its blocks.
            cached = await self.load.compute(self.prefix_cache, parsed.prompts)
        eos_first = self.eos_first > 0 and self._rng.random() < self.eos_first
        outputs = [[generate(parsed.sampling, eos_first) for _ in range(parsed.sampling.n)]
                   for _ in parsed.prompts]
        answer_kv: Any = None
        if kv.get("do_remote_decode"):  # a prefill leg (relay or mooncake)
            engine_id = self.engine_ids.get(rank)
            if engine_id is None:
                raise Problem(400, f"no data parallel rank {rank}")
            answer_kv = prefill_kv(self, parsed, kv, engine_id, request_id, outputs[0][0],
                                   cached)
        elif kv.get("do_remote_prefill"):  # a decode leg that pulls KV
            cached = await pull_kv(self, parsed, kv, request_id)
        elif body.get("bootstrap_room") is not None and body.get("bootstrap_host"):
            await sglang_kv(self, body, rooms_of(parsed.route, body,
                                                 batch_size(parsed.route, body)))
        for prompt in parsed.prompts:
            self.prefix_cache.insert(prompt)
        if parsed.route == CHAT and not kv.get("do_remote_decode"):
            # vLLM caches the generated tokens' blocks too: the next turn, which
            # repeats this answer after the template's role, hits them.
            self.prefix_cache.insert(parsed.prompts[0] + tokenize(
                "\nassistant " + outputs[0][0].text))
        store = parsed.route == RESPONSES and body.get("store", True) is not False
        return Result(parsed, request_id, parsed.model, int(time.time()), outputs, cached,
                      self.prompt_tokens_details, answer_kv,
                      bool(body.get("return_token_ids")), store, body)

    async def _send(self, responder: Responder, result: Result,
                    orca: list[tuple[bytes, bytes]] | None = None) -> None:
        if result.parsed.route == SGLANG_GENERATE:
            await send_generate(responder, result)
            return
        if result.store:  # vLLM keeps a stored response (for ever, without eviction)
            self.stored_responses[result.response_id] = responses_object(result, True)
        if not result.parsed.stream:
            await responder.send_bytes(200, json_body(answer(result)),
                                       [(b"content-type", b"application/json"),
                                        *(orca or ()), *self.faults.extra_headers])
            return
        events = stream(result)
        await responder.start(200, [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    *self.faults.extra_headers])
        self.open_streams += 1
        finished = False
        try:
            if events.head:
                await responder.write(b"".join(events.head))
            for i, step in enumerate(events.steps):
                if self.faults.die_after_chunks is not None and i >= self.faults.die_after_chunks:
                    raise AbortResponse()  # the connection closes without the last chunk
                await responder.write(step)
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
            await responder.write(b"".join(events.tail()))
            await responder.end()
            finished = True
        finally:
            self.open_streams -= 1
            if not finished:
                self.aborted_streams += 1


async def start_pair(host: str = "127.0.0.1", *, ranks: int = 1, stream_chunks: int | None = None,
                     chunk_delay: float = 0.0, record: bool = True,
                     ports: tuple[int, int] = (0, 0), bootstrap_port: int = 0,
                     **knobs: Any) -> tuple[DemoBackend, DemoBackend]:
    """A prefill and a decode backend sharing one KV registry."""
    registry = KvRegistry()
    prefill = DemoBackend("prefill", ranks=ranks, registry=registry, record=record, **knobs)
    decode = DemoBackend("decode", registry=registry, stream_chunks=stream_chunks,
                         chunk_delay=chunk_delay, record=record, **knobs)
    await prefill.start(host, ports[0], bootstrap_port=bootstrap_port)
    await decode.start(host, ports[1], bootstrap_port=None)
    return prefill, decode

