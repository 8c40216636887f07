"""Pure body shaping: from the client's JSON object to the prefill and decode bodies.

No I/O here. Each rule names the vLLM behaviour it exists for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from json.encoder import encode_basestring as _string
from typing import Any, Callable

from .._types import KV, Body, Headers
from ..answers import COMPACT_UTF8_JSON, json_body
from ..routes import CHAT, GENERATE, MESSAGES, RESPONSES
from ..upstream.endpoint import Endpoint
from .rules import (
    GENERATE_SAMPLING_DROPPED,
    MESSAGES_PREFILL_DROPPED,
    PREFILL_DROPPED,
    RESPONSES_PREFILL_DROPPED,
)


def serialise(body: Body) -> bytes:
    """A leg's body as compact JSON."""
    return json_body(body)


# Below this many bytes of client body, encoding each leg whole (one call into
# the C encoder) is cheaper than writing its fields one by one.
SHARED_ENCODING_MIN_BYTES = 2048


class SharedEncoding:
    """``serialise`` for the legs of one request, the client's prompt encoded once.

    Each leg is the client's body with a few small fields changed (the shaping
    functions here copy the top level and share every value they keep), so the
    prompt (messages, prompt, input, tools: nearly all of the bytes) is the
    same object in every leg. A value a leg shares with the client's body is
    encoded the first time and reused; every other value is encoded as it
    comes. The bytes are ``serialise``'s, exactly (tests/handshakes pin that).
    """

    __slots__ = ("_client", "_encoded")

    def __init__(self, client: Body) -> None:
        self._client = client
        self._encoded: dict[str, str] = {}  # a key the legs share -> "key":value

    def serialise(self, leg: Body) -> bytes:
        client, encoded = self._client, self._encoded
        parts = []
        for key, value in leg.items():
            if client.get(key, _ABSENT) is value:
                member = encoded.get(key)
                if member is None:
                    member = encoded[key] = _member(key, value)
            else:
                member = _member(key, value)
            parts.append(member)
        try:
            return ("{" + ",".join(parts) + "}").encode()
        except UnicodeEncodeError:  # a lone surrogate: serialise escapes the whole leg
            return serialise(leg)


def leg_serialiser(client: Body, client_bytes: int) -> Callable[[Body], bytes]:
    """How the legs of a request are serialised: sharing the prompt's encoding when
    the body is large enough for that to pay."""
    if client_bytes < SHARED_ENCODING_MIN_BYTES:
        return serialise
    return SharedEncoding(client).serialise


_ABSENT = object()


def _member(key: str, value: Any) -> str:
    """``"key":value`` as json_body's UTF-8 encoder writes it inside an object."""
    kind = type(value)
    if kind is str:
        written = _string(value)
    elif value is None:
        written = "null"
    elif value is True:
        written = "true"
    elif value is False:
        written = "false"
    elif kind is int:
        written = int.__repr__(value)
    elif kind is float:
        written = float.__repr__(value)  # finite: strict_json refused the others
    else:
        written = COMPACT_UTF8_JSON.encode(value)
    return _string(key) + ":" + written


def primed_prefill_body(body: Body, kv_transfer_params: Body | None,
                        surface: str = CHAT) -> Body:
    """The prefill leg of relay and mooncake: one token, not streamed, KV kept.

    Only what computes the prompt stays: the fields of rules.PREFILL_DROPPED
    (and the other surfaces' tables) go, each of which would end the prefill
    early, be rejected, or be wasted work; everything that can change the
    prompt's tokens (messages, prompt, tools, chat template fields, ...) is
    kept. ``ignore_eos``: vLLM keeps the KV for the remote decoder only when
    the request stops on the length cap; an EOS first token frees it.
    ``max_completion_tokens`` wins over ``max_tokens`` in chat, so it is capped
    too, when the client sent it. ``n`` > 1 would make n engine requests and n
    KV copies (under Mooncake n children sharing one transfer id): the prefill
    leg asks for one; decode keeps the client's n.
    """
    if surface == RESPONSES:
        prefill = _without(body, RESPONSES_PREFILL_DROPPED)
        prefill["max_output_tokens"] = 1
        prefill["store"] = False
        prefill["ignore_eos"] = True
    elif surface == MESSAGES:
        prefill = _without(body, MESSAGES_PREFILL_DROPPED)
        prefill["max_tokens"] = 1
    elif surface == GENERATE:
        prefill = dict(body)
        prefill["sampling_params"] = _one_token(_without(body["sampling_params"],
                                                         GENERATE_SAMPLING_DROPPED))
    else:
        prefill = _one_token(_without(body, PREFILL_DROPPED))
        if "max_completion_tokens" in body:
            prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    if kv_transfer_params is not None:
        prefill[KV] = kv_transfer_params
    else:
        prefill.pop(KV, None)
    return prefill


def _without(body: Body, dropped: dict[str, str]) -> Body:
    return {k: v for k, v in body.items() if k not in dropped}


def _one_token(params: Body) -> Body:
    """The cap, ``ignore_eos`` and ``n`` of a one-token prefill, in chat/completions
    request fields or in vLLM's sampling params (the same names)."""
    params["max_tokens"] = 1
    if "n" in params:
        params["n"] = 1
    params["ignore_eos"] = True
    return params


def relay_prefill_body(body: Body, surface: str = CHAT) -> Body:
    return primed_prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False},
                               surface)


def relay_decode_body(body: Body, prefill_kv: Any, prompt_token_ids: Any = None) -> Body:
    """Decode gets prefill's kv_transfer_params with the flags turned round, or none.

    Every other key is passed on verbatim, whatever its shape (NIXL's nested
    ``remote_block_ids``, ``tp_size``, ``remote_registration_generation``, the
    older Mooncake connector's ``remote_host``/``remote_port``, ...). When
    prefill returned nothing usable (null, not an object, empty, half-filled:
    ``half_filled``), decode gets
    no kv_transfer_params at all and computes the prompt itself: a half-filled
    dict makes NIXL decode assert and Mooncake decode wait. ``prompt_token_ids``
    (tokenize once, opt-in) go inside the params.
    """
    kv = relay_decode_params(prefill_kv, prompt_token_ids)
    if kv is None:
        return body
    decode = dict(body)
    decode[KV] = kv
    return decode


_FLAGS = ("do_remote_prefill", "do_remote_decode")


def half_filled(prefill_kv: Any) -> str | None:
    """Why prefill's kv_transfer_params must not reach decode (PROTOCOL.md: never a
    half-filled dict), or None: a NIXL-shaped dict (``remote_engine_id``) without
    ``remote_block_ids`` makes NIXL's decode scheduler assert and take its engine
    core down; block ids that are not a list are no connector's; a dict of the
    flags alone tells decode nowhere to pull from. Other shapes are relayed as
    they came (the older Mooncake connector's ``remote_host``/``remote_port``
    alone, connectors lowproxy does not know)."""
    if not isinstance(prefill_kv, dict) or not prefill_kv:
        return None  # nothing at all: no dict to fill (Mooncake 0.16+ answers null)
    if "remote_block_ids" in prefill_kv:
        if not isinstance(prefill_kv["remote_block_ids"], list):
            return "remote_block_ids is not a list"
        return None
    if "remote_engine_id" in prefill_kv:
        return "remote_engine_id without remote_block_ids"
    if all(key in _FLAGS for key in prefill_kv):
        return "only the do_remote_* flags"
    return None


def relay_decode_params(prefill_kv: Any, prompt_token_ids: Any = None) -> Body | None:
    """Decode's kv_transfer_params in relay_decode_body, or None for none at all
    (also for a half-filled dict: decode then computes the prompt itself)."""
    if not isinstance(prefill_kv, dict) or not prefill_kv:
        return None
    # NIXL's answer, the common one, is checked in two lookups; others in full.
    if not isinstance(prefill_kv.get("remote_block_ids"), list) and half_filled(prefill_kv):
        return None
    kv = dict(prefill_kv)
    kv["do_remote_prefill"] = True
    kv["do_remote_decode"] = False
    if isinstance(prompt_token_ids, list):
        kv["prompt_token_ids"] = prompt_token_ids
    return kv


def mooncake_bodies(body: Body, transfer_id: str, engine_id: str,
                    bootstrap_addr: str, surface: str = CHAT) -> tuple[Body, Body]:
    """Prefill and decode bodies of the vLLM 0.16+ concurrent Mooncake handshake."""
    prefill = primed_prefill_body(
        body, {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
        surface)
    decode = dict(body)
    decode[KV] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap_addr,
    }
    return prefill, decode


def sglang_body(body: Body, bootstrap_host: str, bootstrap_port: int, room: int | list[int],
                rid: str | None = None) -> Body:
    """SGLang PD: the same body to both legs plus the three bootstrap fields.

    ``room``: one, or a list with one per request SGLang makes of a batch
    (handshakes/sglang.py).

    ``rid``: the proxy's own request id on both legs (never the client's), so
    that either leg can be aborted by it (SGLang aborts by rid, prefix match).
    """
    shaped = dict(body)
    shaped["bootstrap_host"] = bootstrap_host
    shaped["bootstrap_port"] = bootstrap_port
    shaped["bootstrap_room"] = room
    if rid is not None:
        shaped["rid"] = rid
    return shaped


@dataclass(slots=True)
class Plan:
    """What to send for one request: made by a handshake's plan(), run by dispatch.

    Decode only when ``prefill`` is None. Otherwise the prefill leg goes to
    ``prefill`` and decode gets ``decode_body`` at the same time
    (``concurrent``), or, in turn, the body ``decode_body_for`` makes from
    prefill's ``kv_transfer_params``. ``client_body``, or ``fallback`` where only
    the body's bytes are kept, gives the recompute fallback (decode computes the
    prompt itself); ``prefill_failure`` says the prefill leg failed before it
    could be sent (no endpoint, no bootstrap map), so dispatch applies the
    failure policy at once.
    """

    method: bytes
    decode_target: bytes
    decode_body: bytes | None
    client_body: Body | None = None
    prefill: Endpoint | None = None  # the chosen prefill endpoint
    prefill_target: bytes = b""
    prefill_body: bytes = b""
    prefill_headers: Headers = field(default_factory=list)
    concurrent: bool = False
    decode_body_for: Callable[[Any, Any], bytes] | None = None  # (kv params, token ids)
    # Work for decode_body_for done while the prefill leg runs (relay: the client's
    # body encoded), so that prefill's answer is followed by decode's leg sooner.
    prepare_decode: Callable[[], None] | None = None
    prefill_failure: str | None = None
    skip_reason: str | None = None
    # SGLang: the rids each leg is served under (the proxy's own; one per child
    # of a batch), to abort them by.
    abort_rids: tuple[str, ...] = ()
    # SGLang's /generate with return_logprob: decode's answer gets the prefill's
    # prompt logprobs in front of its own (sglang_logprobs.py).
    merge_input_logprobs: bool = False
    # Gives fallback_body's bytes where the plan keeps the client's body otherwise
    # than as client_body (relay: encoded while the prefill leg runs).
    fallback: Callable[[], bytes] | None = None

    def fallback_body(self) -> bytes:
        """Decode's body when there is no KV to pull: the client's, as it came."""
        if self.fallback is not None:
            return self.fallback()
        return serialise(self.client_body if self.client_body is not None else {})

    def decode_body_made(self) -> None:
        """Relay's decode body is made: both legs' bodies, the prepared encoding (the
        fallback's too) and any parsed client body are not needed any more. Let go of
        them, so that a request waiting for decode's response head (a connect storm
        of new streams keeps thousands waiting at once) holds no prompt; the peak of
        those waits is what the process's memory keeps (pymalloc's arenas stay
        mapped)."""
        self.client_body = None
        self.prefill_body = b""
        self.decode_body_for = None
        self.prepare_decode = None
        self.fallback = None


def decode_only_plan(method: bytes, target: bytes, body: bytes | None,
                     client_body: Body | None = None, prefill_failure: str | None = None,
                     skip_reason: str | None = None) -> Plan:
    return Plan(method, target, body, client_body=client_body,
                prefill_failure=prefill_failure, skip_reason=skip_reason)
