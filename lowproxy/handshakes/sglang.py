"""SGLang PD: the same body to both legs, plus where and under which room to meet."""

from __future__ import annotations

from .._types import Body
from ..routes import CHAT
from ..upstream.endpoint import Endpoint
from .legs import Plan, serialise, sglang_body


def plan(body: Body, target: bytes, path: bytes, prefill: Endpoint, bootstrap_host: str,
         bootstrap_port: int, room: int, rid: str, surface: str = CHAT) -> Plan:
    """Both legs at once, the same body, the same room and the same proxy-made rid."""
    shaped = serialise(sglang_body(body, bootstrap_host, bootstrap_port, room, rid))
    return Plan(b"POST", target, shaped, client_body=body, prefill=prefill,
                prefill_target=path, prefill_body=shaped, concurrent=True,
                abort_rid=rid)
