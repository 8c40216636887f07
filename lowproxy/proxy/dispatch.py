"""Run a Plan: the one executor for every request that reaches a backend.

Read top to bottom, as Go's ReverseProxy is: ``run`` opens decode's response
(``_decode_response``: decode only, the legs in turn, or both at once with the
commit point), then copies decode's answer to the client (answer_copy.py, inside
the decode timeout).
Every failure on the way is an exception of the Failure family, and one
function, ``failure_answers.answer_failure``, decides its metric label, its log
line and the client's answer. The prefill-failure policy (PD_PROXY_ON_PREFILL_FAILURE) is
applied in one place, ``_without_kv``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ..config.settings import Config
from ..downstream.messages import ClientGone, ResponseWriter
from ..handshakes.bootstrap import BootstrapCache
from ..handshakes.legs import Plan, half_filled
from ..handshakes.rules import NO_HEALTHY_DECODE
from ..observability import logs
from ..observability.metrics import Metrics
from ..routes import MESSAGES
from ..routing.engine_load import ASK_ORCA, EngineLoads
from ..routing.groups import BackendGroup
from ..routing.response_homes import id_for
from ..timeouts import Deadlines
from ..upstream.endpoint import Endpoint
from ..upstream.errors import UpstreamUnreachable, UpstreamUntrusted
from ..upstream.pool import Upstream, UpstreamError, UpstreamResponse, UpstreamTimeout
from .answer_copy import relay
from .auxiliary_legs import BackgroundTasks, send_prefill_leg
from .exchange import Exchange, PrefillLeg
from .failure_answers import answer_failure
from .failures import (
    DecodeFailed,
    DecodeTimedOut,
    Failure,
    NoDecode,
    PrefillFailed,
    PrefillRefused,
    PrefillResult,
)
from .leg_aborts import LegAborts
from .prefill_watch import PrefillWatch
from .tracing import Tracing

log = logging.getLogger("lowproxy.dispatch")
# vLLM prefill legs left to finish after their request ended, at most, per process.
MAX_ORPHANED_PREFILLS = 1024


def _nobody_listens(exchange: Exchange) -> None:
    pass


class Dispatcher:
    """Sends the legs of planned requests; owns the prefill legs left to finish.

    ``prefill_ended(exchange)`` is told once per request that its prefill leg is
    over, or that none will be sent: whoever counts prefill load listens there.
    """

    def __init__(self, config: Config, upstream: Upstream, prefill: BackendGroup,
                 decode: BackendGroup, bootstrap: BootstrapCache, metrics: Metrics,
                 tracing: Tracing | None,
                 prefill_ended: Callable[[Exchange], None] = _nobody_listens) -> None:
        self.config = config
        self.prefill_ended = prefill_ended
        self.upstream = upstream
        self.prefill = prefill
        self.decode = decode
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.tracing = tracing
        self.background = BackgroundTasks()  # prefill legs left to finish, aborts
        self.aborts = LegAborts(upstream, self.background, config.sglang_admin_api_key)
        self.deadlines = Deadlines()  # the legs' bounds
        self.engine_loads: EngineLoads | None = None  # set by the proxy: ORCA reports
        self.orphans = 0  # vLLM prefill legs still running for requests that are over

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.background.loop = self.deadlines.loop = loop

    async def close(self, grace: float = 0.0) -> None:
        """Prefill legs in flight get ``grace`` seconds, then are cancelled."""
        await self.background.close(grace)

    # -- the pipeline

    async def run(self, exchange: Exchange, responder: ResponseWriter,
                  planning: Plan | Awaitable[Plan]) -> None:
        """Plan, open decode's response, copy it to the client; answer any failure.

        A generation's ``planning`` is awaited here so that nothing up the stack
        keeps the client's body: once decode's response is open the plan is
        dropped, and a stream that lasts minutes holds no copy of the prompt.
        """
        try:
            plan = planning if isinstance(planning, Plan) else await planning
            del planning  # done with: nothing of it is kept while the answer streams
            if plan.skip_reason is not None:
                exchange.skip_reason = plan.skip_reason
                self.metrics.prefill_legs.inc(exchange.handshake or "", "skipped",
                                              plan.skip_reason)
            abort_rids = plan.abort_rids
            response = await self._decode_response(exchange, responder, plan)
            del plan
            # Decode's answer to the client, within the decode timeout; the response is
            # always closed. Here, not in a method of its own: a frame fewer held by
            # every open stream.
            try:
                with self._decode_deadline(exchange):
                    await relay(self.metrics, exchange, responder, response)
            except TimeoutError:
                raise DecodeTimedOut() from None
            except (asyncio.CancelledError, ClientGone) as exc:
                if isinstance(exc, ClientGone) or responder.client_gone:
                    self.metrics.decode_legs.inc("client-gone")
                    self.aborts.abort(exchange, response.endpoint, "decode", abort_rids)
                raise
            finally:
                await response.aclose()
        except Failure as failure:
            await answer_failure(self.config, self.metrics, exchange, responder, failure)
        finally:
            if exchange.prefill_leg is PrefillLeg.NOT_SENT:
                self._report_prefill_ended(exchange)  # none was sent, and none will be

    def _report_prefill_ended(self, exchange: Exchange) -> None:
        if exchange.prefill_leg is not PrefillLeg.ENDED:
            exchange.prefill_leg = PrefillLeg.ENDED
            self.prefill_ended(exchange)

    async def _decode_response(self, exchange: Exchange, responder: ResponseWriter,
                               plan: Plan) -> UpstreamResponse:
        """Decode's response head, once any prefill leg has committed."""
        if plan.prefill is not None and plan.prefill_failure is None:
            if not plan.abort_rids and self.decode.none_ready(exchange.model):
                # Every decode failed its health checks or refused a connection
                # moments ago (or a dns+ name resolves to none): a KV computed now
                # would most likely be read by nobody (and pinned for minutes).
                # Decode is still tried, with the whole prompt: 503 if it is down,
                # an answer if it just came back. Not under sglang, whose decode
                # needs the room.
                exchange.skip_reason = NO_HEALTHY_DECODE
                self.metrics.prefill_legs.inc(exchange.handshake or "", "skipped",
                                              NO_HEALTHY_DECODE)
                return await self._open_decode_bounded(exchange, responder, plan.method,
                                                       plan.decode_target,
                                                       plan.fallback_body())
            if plan.concurrent:
                return await self._concurrent(exchange, responder, plan)
            return await self._in_turn(exchange, responder, plan)
        body = plan.decode_body
        if plan.prefill_failure is not None:
            # The prefill leg could not even be sent (no endpoint, no bootstrap map).
            self.metrics.prefill_legs.inc(exchange.handshake or "", "error")
            logs.warn(log, f"prefill leg not sent: {plan.prefill_failure}", exchange.request_id,
                      backend=plan.prefill.label if plan.prefill is not None else None,
                      handshake=exchange.handshake)
            body = self._without_kv(exchange, plan, plan.prefill_failure)
        return await self._open_decode_bounded(exchange, responder, plan.method,
                                               plan.decode_target, body)

    async def _in_turn(self, exchange: Exchange, responder: ResponseWriter,
                       plan: Plan) -> UpstreamResponse:
        """Relay: prefill answers first; decode's body carries its kv_transfer_params
        (prepared while prefill computes)."""
        result = await self._prefill_leg(exchange, plan, want_kv=True,
                                         while_waiting=plan.prepare_decode)
        if result.ok and plan.decode_body_for is not None:
            kv = result.kv_transfer_params
            problem = None if not isinstance(kv, dict) or isinstance(
                kv.get("remote_block_ids"), list) else half_filled(kv)
            if problem is not None:
                logs.warn(log, f"prefill answered kv_transfer_params decode cannot use "
                          f"({problem}); decode will recompute the prompt",
                          exchange.request_id, backend=exchange.prefill_backend)
            body = plan.decode_body_for(result.kv_transfer_params, result.prompt_token_ids)
            exchange.prefill_cached_tokens = result.cached_tokens
        else:
            body = self._without_kv(exchange, plan, result)
        del result
        plan.decode_body_made()
        return await self._open_decode_bounded(exchange, responder, plan.method,
                                               plan.decode_target, body)

    async def _concurrent(self, exchange: Exchange, responder: ResponseWriter,
                          plan: Plan) -> UpstreamResponse:
        """Mooncake and SGLang: both legs at once; decode's response after the commit point.

        Decode cannot produce a token before the KV arrives, so holding its
        response until prefill has answered 2xx costs nothing and means the
        client never sees a response that cannot complete. If prefill fails,
        the held decode connection is closed (vLLM aborts the request;
        otherwise it would wait 480 s, or for ever before 0.30). The prefill
        leg runs in a task of its own (prefill_watch.py): a client that leaves
        aborts decode at once, but a prefill leg in flight is left to finish
        (bounded by the prefill timeout), since aborting it mid-transfer can
        leak KV blocks. Decode's head is awaited in this task.
        """
        loop = self.background.running_loop()
        prefill_task = self.background.spawn(self._prefill_leg(exchange, plan, want_kv=False))
        owner = asyncio.current_task(loop)
        assert owner is not None, "run in a request's task"
        watch = PrefillWatch(prefill_task, owner)
        response: UpstreamResponse | None = None
        prefill_closed = False
        try:
            with self.deadlines.within(self.config.decode_timeout):
                try:
                    if plan.abort_rids:
                        # SGLang: the prefill leg goes out first, then decode in the
                        # same loop iteration, as SGLang's router orders them. Mooncake
                        # saves the iteration: decode's request goes now, prefill's in
                        # the next iteration, as soon as it would have anyway.
                        await asyncio.sleep(0)
                    response = await self._open_decode(exchange, responder, plan.method,
                                                       plan.decode_target, plan.decode_body)
                except asyncio.CancelledError:
                    if not watch.ours():
                        raise
                    # Prefill failed first: this decode leg is closed (its
                    # connection discarded as the wait was cancelled).
                except BaseException as exc:
                    watch.opening = False
                    # Decode failed first: that is the client's answer, and a
                    # prefill still running is not waited for (nor, when no decode
                    # got the request, left to pin a KV nobody reads).
                    if not prefill_task.done():
                        prefill_closed = await self.aborts.close_prefill(
                            exchange, plan, prefill_task, isinstance(exc, NoDecode))
                    raise
                watch.opening = False
                if (response is not None and not 200 <= response.status < 300
                        and not prefill_task.done()):
                    # Decode answered an error while prefill still runs: relayed at once,
                    # and the prefill closed (that decode will never read its KV).
                    prefill_closed = await self.aborts.close_prefill(exchange, plan,
                                                                     prefill_task, True)
                    return response
                result = await watch.result(loop)
                if result.ok and response is not None and result.outcome != "stopped":
                    # Committed: decode reads the KV prefill made.
                    exchange.prefill_cached_tokens = result.cached_tokens
                    exchange.prefill_input_logprobs = result.input_logprobs
                    return response
                self.aborts.drop_decode(exchange, response, plan.abort_rids)
                response = None
                body = self._recomputed(exchange, plan) if result.outcome == "stopped" \
                    else self._without_kv(exchange, plan, result)
                exchange.decode_started = None  # a new decode leg, its own timeout
                answer = await self._open_decode_bounded(
                    exchange, responder, plan.method, plan.decode_target, body)
        except TimeoutError:
            self.aborts.drop_decode(exchange, response, plan.abort_rids)
            raise DecodeTimedOut() from None
        except BaseException:
            # The client left, or decode failed: abort decode at once; a prefill
            # still running is left to finish, unless it can be aborted by rid.
            self.aborts.drop_decode(exchange, response, plan.abort_rids)
            if not prefill_task.done() and not prefill_closed and plan.prefill is not None:
                self.aborts.abort(exchange, plan.prefill, "prefill", plan.abort_rids)
                if not plan.abort_rids:
                    self._orphaned(exchange, plan.prefill, prefill_task)
            raise
        return answer

    def _orphaned(self, exchange: Exchange, endpoint: Endpoint,
                  prefill_task: asyncio.Task[PrefillResult]) -> None:
        """A vLLM prefill leg left to finish for a request that is over (aborting it
        mid-transfer can leak KV blocks), up to MAX_ORPHANED_PREFILLS at once: clients
        leaving faster than prefills end would otherwise hold a task, a connection
        and a file descriptor each for up to the prefill timeout (300 s), without
        bound. Past it the leg is closed (vLLM aborts it), and the log says so."""
        if self.orphans >= MAX_ORPHANED_PREFILLS:
            logs.warn(log, f"prefill leg closed: {MAX_ORPHANED_PREFILLS} prefill legs of "
                      "requests already over are still running", exchange.request_id,
                      backend=endpoint.label, handshake=exchange.handshake)
            prefill_task.cancel()
            return
        self.orphans += 1
        prefill_task.add_done_callback(self._orphan_ended)

    def _orphan_ended(self, _: asyncio.Task[PrefillResult]) -> None:
        self.orphans -= 1

    def _without_kv(self, exchange: Exchange, plan: Plan,
                    failed: PrefillResult | str) -> bytes:
        """The prefill-failure policy: decode recomputes the prompt, or the client gets 502.

        A prefill that refused the request itself (400, 413, 422) is neither:
        its answer goes to the client, as decode would fail the same way.
        """
        if isinstance(failed, PrefillResult):
            if failed.outcome == "rejected":
                raise PrefillRefused(failed.status, failed.body)
            detail = failed.detail
        else:
            detail = failed
        if self.config.on_prefill_failure == "error" or exchange.handshake == "sglang":
            # An SGLang decode in disaggregation mode refuses a request without a
            # bootstrap room: it cannot recompute the prompt, whatever the policy.
            raise PrefillFailed(detail)
        return self._recomputed(exchange, plan)

    def _recomputed(self, exchange: Exchange, plan: Plan) -> bytes:
        """Decode's body without transferred KV: it computes the prompt itself. Also
        for a Mooncake prefill that stopped (nothing failed, whatever the policy: its
        KV is gone, and only decode can still answer)."""
        self.metrics.prefill_legs.inc(exchange.handshake or "", "recompute")
        logs.warn(log, "decode will recompute the prompt without transferred KV",
                  exchange.request_id, handshake=exchange.handshake,
                  backend=exchange.prefill_backend)
        return plan.fallback_body()

    # -- decode

    async def _open_decode_bounded(self, exchange: Exchange, responder: ResponseWriter,
                                   method: bytes, target: bytes,
                                   body: bytes | None) -> UpstreamResponse:
        try:
            with self._decode_deadline(exchange):
                return await self._open_decode(exchange, responder, method, target, body)
        except TimeoutError:
            raise DecodeTimedOut() from None

    async def _open_decode(self, exchange: Exchange, responder: ResponseWriter, method: bytes,
                           target: bytes, body: bytes | None) -> UpstreamResponse:
        """Send the decode leg; return once decode's response head has arrived.

        Endpoints that refuse the connection are cooled down and the next one is
        tried (nothing reached them, so nothing runs twice).
        """
        if exchange.decode_started is None:
            exchange.decode_started = time.perf_counter()
        tried: tuple[Endpoint, ...] = ()
        last_error = "no decode endpoint (none configured, or a dns+ name resolves to none)"
        while True:
            endpoint = self._preferred_decode(exchange, tried)
            if endpoint is None:
                endpoint = self.decode.pick_least_loaded(tried, exchange.model)
            if endpoint is None and not tried:
                # All cooling down: try one anyway.
                endpoint = self.decode.soonest_usable(exchange.model)
            if endpoint is None:
                raise NoDecode(last_error)
            exchange.decode_endpoint = endpoint
            exchange.decode_backend = endpoint.label  # named in every log line from here
            sent = body
            if exchange.response_slot is not None and body is not None:
                # The response id names this decode, whose store will hold it.
                sent = body.replace(exchange.response_slot, id_for(endpoint).encode(), 1)
            try:
                # PD_PROXY_DECODE_FIRST_BYTE_TIMEOUT_SECONDS bounds the wait for
                # decode's response head (none by default: it waits for the KV).
                with self.deadlines.within(self.config.decode_first_byte_timeout):
                    # 1xx (103 Early Hints) go on to the client (RFC 9110 15.2).
                    response = await self.upstream.request(
                        endpoint, method, target, exchange.upstream_headers, sent,
                        on_informational=responder.informational)
            except TimeoutError:
                raise DecodeFailed(UpstreamTimeout(
                    f"{endpoint.label} sent no response head within "
                    f"{self.config.decode_first_byte_timeout:g}s", endpoint)) from None
            except UpstreamUntrusted as exc:
                raise NoDecode(exc.detail) from None
            except UpstreamError as exc:
                if not isinstance(exc, UpstreamUnreachable):
                    raise DecodeFailed(exc) from None
                self.decode.cool_down(endpoint)
                logs.warn(log, f"decode backend unreachable: {exc.detail}",
                          exchange.request_id, backend=endpoint.label)
                last_error = exc.detail
                tried += (endpoint,)
                continue
            endpoint.cooldown_until = 0.0  # it answered: usable again (and ready)
            if 200 <= response.status < 300:
                endpoint.answered_at = time.monotonic()  # serving, whatever its checks say
            return response

    def _preferred_decode(self, exchange: Exchange,
                          tried: tuple[Endpoint, ...]) -> Endpoint | None:
        """The decode cache-aware routing chose (cache_router.py), while it can be used."""
        preferred = exchange.decode_preferred
        if preferred is None or preferred in tried or not preferred.usable(time.monotonic()) \
                or preferred not in self.decode.endpoints:
            return None
        return self.decode.count_sent(preferred)

    def _decode_deadline(self, exchange: Exchange) -> Any:
        """What is left of PD_PROXY_DECODE_TIMEOUT_SECONDS for this decode leg.

        No bound by default: a generation may stream for many minutes.
        """
        limit = self.config.decode_timeout
        if limit is None or exchange.decode_started is None:
            return self.deadlines.within(limit)
        return self.deadlines.within(
            max(0.0, limit - (time.perf_counter() - exchange.decode_started)))

    # -- prefill

    async def _prefill_leg(self, exchange: Exchange, plan: Plan, want_kv: bool,
                           while_waiting: Callable[[], None] | None = None) -> PrefillResult:
        """Send one prefill leg and read its answer; bounded by the prefill timeout.

        Never raises for a backend failure: the outcome says what happened and a
        warning names it, with the request id. A failure drops the endpoint's
        cached bootstrap map (a restarted prefill has new engine ids).
        """
        handshake = exchange.handshake or "relay"
        endpoint = plan.prefill
        assert endpoint is not None  # only a two-leg plan has a prefill leg
        started = time.perf_counter()
        exchange.prefill_backend = endpoint.label
        exchange.prefill_leg = PrefillLeg.RUNNING
        # An ORCA report informs cache-aware routing's choice between prefill endpoints:
        # with one endpoint there is no choice, and asking costs the engine a report
        # and this leg a header each way (issue 21).
        loads = self.engine_loads if len(self.prefill.endpoints) > 1 else None
        extra = plan.prefill_headers if loads is None else [*plan.prefill_headers, ASK_ORCA]
        try:
            result, status = await send_prefill_leg(
                self.upstream, endpoint, plan.prefill_target, exchange.upstream_headers,
                plan.prefill_body, extra, want_kv, self.config.prefill_timeout, self.deadlines,
                exchange.surface if self.config.rewrite_cached_tokens else None,
                None if loads is None else lambda report: loads.orca(endpoint, report),
                while_waiting,
                # Mooncake 0.16+: decode already waits for this KV, which a stopped
                # prefill has freed. Only Messages can stop: the other surfaces'
                # prefill legs carry ignore_eos and none of the stop fields, so
                # theirs are not parsed for it (6 us a request).
                MESSAGES if handshake == "mooncake" and not want_kv
                and exchange.surface == MESSAGES else None,
                plan.merge_input_logprobs)
        finally:
            # Now, not when a stream that may last minutes ends: its prompt no
            # longer loads the prefill endpoint.
            self._report_prefill_ended(exchange)
        if result.outcome == "unreachable":
            self.prefill.cool_down(endpoint)
            result.outcome = "error"
        elapsed = time.perf_counter() - started
        exchange.prefill_ms = elapsed * 1000.0
        self.metrics.prefill_duration.observe(elapsed, handshake)
        self.metrics.prefill_legs.inc(handshake, result.outcome)
        if result.cached_tokens is not None and result.prompt_tokens:
            self.metrics.prefill_prompt_tokens.inc(handshake, amount=result.prompt_tokens)
            self.metrics.prefill_cached_tokens.inc(handshake, amount=result.cached_tokens)
        if exchange.span is not None and self.tracing is not None:
            self.tracing.record_prefill(exchange, endpoint.label, started, status, result.ok,
                                        concurrent=not want_kv)
        if not result.ok:
            self.bootstrap.forget(endpoint)
            logs.warn(log, f"prefill leg failed ({result.outcome}): {result.detail}",
                      exchange.request_id, backend=endpoint.label, handshake=handshake)
        elif result.outcome == "stopped":
            logs.warn(log, f"prefill leg stopped: {result.detail}", exchange.request_id,
                      backend=endpoint.label, handshake=handshake)
        return result
