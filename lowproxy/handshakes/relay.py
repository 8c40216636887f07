"""The relay handshake (GCO proxy, NIXL, vLLM Mooncake 0.13-0.15): prefill, then decode.

Prefill computes the prompt with one token and answers with the
kv_transfer_params decode needs to pull the KV; decode gets them with the flags
turned round. Without them (prefill failed, or returned none) decode computes
the prompt itself, unless PD_PROXY_ON_PREFILL_FAILURE=error.
"""

from __future__ import annotations

from typing import Any, Callable

from .._types import KV, Body
from ..routes import CHAT
from ..upstream.endpoint import Endpoint
from .legs import Plan, relay_decode_params, relay_prefill_body, serialise


def plan(body: Body, target: bytes, path: bytes, prefill: Endpoint, surface: str = CHAT,
         forward_token_ids: bool = False,
         serialise_leg: Callable[[Body], bytes] = serialise) -> Plan:
    """Both legs in turn: decode's body is made from prefill's answer.

    ``forward_token_ids`` (PD_PROXY_FORWARD_PROMPT_TOKEN_IDS, chat only): the
    prefill leg asks for the prompt's token ids and decode gets them in its
    kv_transfer_params, so it skips its own tokenization (vLLM 0.31+).
    ``serialise_leg`` writes both legs (legs.leg_serialiser: the prompt encoded once).
    """
    prefill_body = relay_prefill_body(body, surface)
    if forward_token_ids and surface == CHAT:
        prefill_body["return_token_ids"] = True
    decode_body = DecodeBodyAfterPrefill(body, serialise_leg)
    # No client_body: the decode body keeps the client's (as its encoding, once
    # prepared) and gives the recompute fallback from it.
    return Plan(b"POST", target, None, prefill=prefill,
                prefill_target=path, prefill_body=serialise_leg(prefill_body),
                decode_body_for=decode_body, prepare_decode=decode_body.prepare,
                fallback=decode_body.client_encoded)


_KV_MEMBER = b'"%s":' % KV.encode("ascii")  # "kv_transfer_params": (a plain ASCII key)


class DecodeBodyAfterPrefill:
    """Decode's body in relay: the client's, with prefill's kv_transfer_params added.

    ``prepare()`` encodes the client's body while the prefill leg runs
    (dispatch calls it once that leg is sent), so that when prefill answers
    only its small params are encoded: they are spliced in as the last key,
    where relay_decode_body puts them, so the bytes are what encoding the
    whole decode body gives (tests/handshakes pin that). Without prepare(),
    or when the params are not usable, the body is encoded whole, as before.
    """

    __slots__ = ("_body", "_serialise", "_encoded")

    def __init__(self, body: Body, serialise_leg: Callable[[Body], bytes]) -> None:
        self._body: Body | None = body
        self._serialise = serialise_leg
        self._encoded: bytes | None = None

    def prepare(self) -> None:
        body = self._body
        if self._encoded is None and body is not None:
            self._encoded = self._serialise(body)
            if KV not in body:
                # The encoding is all that is needed from here: a connect storm keeps
                # thousands of prefill legs waiting at once, and the parsed prompt
                # of each would stay in the process's memory peak. (A SharedEncoding
                # serialiser holds the body and its members' encodings too.)
                self._body = None
                self._serialise = serialise

    def client_encoded(self) -> bytes:
        """The client's body as it came: decode's when there is no KV to pull."""
        encoded = self._encoded
        return encoded if encoded is not None else self._serialise(self._body or {})

    def __call__(self, prefill_kv: Any, prompt_token_ids: Any = None) -> bytes:
        body = self._body
        encoded = self._encoded
        kv = relay_decode_params(prefill_kv, prompt_token_ids)
        if kv is None:  # relay_decode_body gives the client's body unchanged
            return self.client_encoded()
        if encoded is None or (body is not None and KV in body):
            # relay_decode_body's, whole (once prepared without the body, never KV in it)
            return self._serialise({**(body or {}), KV: kv})
        member = _KV_MEMBER + serialise(kv)
        return b"{" + member + b"}" if encoded == b"{}" else encoded[:-1] + b"," + member + b"}"
