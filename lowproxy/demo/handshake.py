"""The KV side of the demo backend: what a prefill keeps, what a decode pulls.

Emulated as vLLM 0.33 (and SGLang) behave:

* Mooncake (0.16+, ``transfer_id``; and the 0.13-0.15 relay-style connector):
  a prefill that finishes *stopped* (EOS, a ``stop_token_ids`` id, a stop
  string) frees its KV; only a length-capped one keeps it for decode.
* NIXL keeps the KV either way; its answer carries ``remote_block_ids`` (flat,
  or nested per KV-cache group) and pass-through keys. A NIXL decode given
  ``do_remote_prefill`` without ``remote_block_ids`` fails an assertion in the
  scheduler: the engine core dies and the server stays dead until restarted.
* ``n`` makes n engine requests, so n KV copies (recorded in ``kv_copies``).
* A completions request with several prompts pulls for prompt 0 only; every
  sub-request shares the params (recorded in ``kv_pulls`` and
  ``shared_kv_subrequests``).
* A Mooncake decode given a half-filled dict waits for ever (no pull starts);
  a full one waits ``kv_wait_timeout`` (vLLM 0.30+; None: 0.16-0.28, for ever).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from .engine import Output, Parsed, Problem
from .kv import remote_kv

# The functions below read and change one DemoBackend's state; typed Any
# so that this module stays below backend.py (which imports it).
DemoBackend = Any

NIXL, MOONCAKE_LEGACY = "nixl", "mooncake-0.13"
MOONCAKE_KEYS = ("transfer_id", "remote_engine_id", "remote_bootstrap_addr")


class EngineDead(Exception):
    """The engine core is gone (vLLM's EngineDeadError)."""


async def wait_kv(backend: DemoBackend, key: str, address: str | None,
                  timeout: float | None) -> str:
    """The engine id that computed ``key``, once it is there (the pull)."""
    if not backend.remote_kv or not address:
        return await backend.registry.wait(key, timeout)
    loop = asyncio.get_running_loop()
    end = None if timeout is None else loop.time() + timeout
    while True:  # separate processes: ask the prefill's bootstrap server
        engine = await remote_kv(address, key, take=True)
        if engine is not None:
            return engine
        if end is not None and loop.time() >= end:
            raise asyncio.TimeoutError()
        await asyncio.sleep(0.02)


async def take_kv(backend: DemoBackend, key: str, address: str | None) -> bool:
    if backend.registry.take(key):
        return True
    if backend.remote_kv and address:
        return await remote_kv(address, key, take=True) is not None
    return False


def _addr(host: Any, port: Any) -> str | None:
    return f"http://{host}:{port}" if host and port else None


# -- the prefill leg


def prefill_kv(backend: DemoBackend, parsed: Parsed, kv: dict[str, Any], engine_id: str,
               request_id: str, first: Output, cached: int) -> Any:
    """Keep (or free) the prefill's KV; the kv_transfer_params its answer carries."""
    backend.kv_copies.append(parsed.sampling.n * len(parsed.prompts))
    stopped = first.finish_reason == "stop"
    transfer_id = kv.get("transfer_id")
    if transfer_id:  # vLLM 0.16+ Mooncake: the answer carries nothing useful
        if stopped:
            backend.kv_dropped.append(str(transfer_id))
        else:
            backend.registry.computed(str(transfer_id), engine_id)
        return None
    if backend.faults.kv_params != "default":
        return backend.faults.kv_params
    if backend.relay_connector == MOONCAKE_LEGACY:
        # vLLM 0.13-0.15: decode asks the prefill's side channel for the KV of the
        # same request id; a stopped request returns no params and frees the KV.
        if stopped:
            backend.kv_dropped.append(request_id)
            return None
        backend.registry.computed(f"req-{request_id}", engine_id)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_host": backend.host, "remote_port": backend.side_port}
    remote_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
    backend.registry.computed(remote_id, engine_id)  # NIXL keeps it, stopped or not
    blocks: list[Any] = [1, 2, 3]
    if backend.nested_block_ids:  # one list per KV-cache group (vLLM 0.33)
        blocks = [blocks]
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": blocks, "remote_engine_id": engine_id,
            "remote_request_id": remote_id, "remote_host": backend.host,
            "remote_port": backend.side_port, "tp_size": 1,
            "remote_registration_generation": 0, "remote_prefill_cached_tokens": cached}


# -- the decode leg


def _block_ids_valid(blocks: Any) -> bool:
    if not isinstance(blocks, list):
        return False
    if all(isinstance(b, int) for b in blocks):
        return True  # flat: one KV-cache group (older releases)
    return all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in blocks)


def _no_blocks(blocks: list[Any]) -> bool:
    return all(isinstance(g, list) and not g for g in blocks)  # [] and [[]]


async def pull_kv(backend: DemoBackend, parsed: Parsed, kv: dict[str, Any],
                  request_id: str) -> int:
    """Pull prompt 0's KV as a decode does; how many prompt tokens count as cached.

    Raises Problem (the request fails), EngineDead (the engine core goes), or
    waits for ever where vLLM does.
    """
    prompt = parsed.prompts[0]
    backend.shared_kv_subrequests += len(parsed.prompts) - 1
    if "transfer_id" in kv:
        await _pull_mooncake(backend, kv)
        key = str(kv["transfer_id"])
    elif backend.relay_connector == MOONCAKE_LEGACY:
        address = _addr(kv.get("remote_host"), kv.get("remote_port"))
        if address is None:
            await asyncio.Event().wait()  # no side channel to ask: no pull, no timer
        key = f"req-{request_id}"
        try:
            await wait_kv(backend, key, address, backend.kv_wait_timeout)
        except asyncio.TimeoutError:
            raise Problem(500, "KV transfer timed out", None, "InternalServerError") from None
    else:
        key = await _pull_nixl(backend, kv)
    backend.kv_pulls.append({"key": key, "prompt_index": 0, "prompt_tokens": len(prompt)})
    reported = kv.get("remote_prefill_cached_tokens")
    if isinstance(reported, int) and "transfer_id" not in kv:
        return reported  # NIXL 0.33 reports the prefill's own figure
    return len(prompt)  # the pulled prompt counts as cached


async def _pull_mooncake(backend: DemoBackend, kv: dict[str, Any]) -> None:
    missing = [key for key in MOONCAKE_KEYS if not kv.get(key)]
    if missing:  # vLLM waits for KV that never comes: no pull starts, no timer runs
        backend.stuck_pulls += 1
        await asyncio.Event().wait()
    try:
        engine = await wait_kv(backend, str(kv["transfer_id"]), str(kv["remote_bootstrap_addr"]),
                               backend.kv_wait_timeout)
    except asyncio.TimeoutError:
        raise Problem(500, "KV transfer timed out", None, "InternalServerError",
                      in_stream=True) from None
    if engine != kv["remote_engine_id"]:
        raise Problem(500, f"KV for {kv['transfer_id']} is on engine {engine}, not "
                      f"{kv['remote_engine_id']}", None, "InternalServerError")


async def _pull_nixl(backend: DemoBackend, kv: dict[str, Any]) -> str:
    blocks = kv.get("remote_block_ids")
    if blocks is None:
        # NIXL's scheduler asserts: the engine core dies with every request on it.
        backend.die("assertion failed: do_remote_prefill without remote_block_ids")
        raise EngineDead()
    if not _block_ids_valid(blocks):
        raise Problem(500, f"remote_block_ids has an unknown shape: {blocks!r}", None,
                      "InternalServerError")
    remote_id = str(kv.get("remote_request_id"))
    if _no_blocks(blocks):  # nothing to read: the prefill only frees its request
        await take_kv(backend, remote_id, _addr(kv.get("remote_host"), kv.get("remote_port")))
        return remote_id
    if not await take_kv(backend, remote_id, _addr(kv.get("remote_host"),
                                                   kv.get("remote_port"))):
        raise Problem(500, f"no prefilled KV for request {remote_id}", None,
                      "InternalServerError")
    return remote_id


# -- SGLang


async def sglang_kv(backend: DemoBackend, body: dict[str, Any], rooms: list[Any]) -> None:
    """SGLang PD: the prefill marks each child's room computed, the decode waits
    for each (``rooms``: one per child, sglang.rooms_of)."""
    if backend.role == "prefill":
        for room in rooms:
            backend.registry.computed(f"room-{room}", backend.name)
        return
    address = _addr(body.get("bootstrap_host"), body.get("bootstrap_port"))
    try:
        for room in rooms:
            await wait_kv(backend, f"room-{room}", address, backend.kv_wait_timeout)
    except asyncio.TimeoutError:
        raise Problem(500, "KV transfer timed out", None, "InternalServerError") from None
