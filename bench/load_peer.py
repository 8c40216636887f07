"""A peer proxy run side by side with lowproxy: ``bench/load.py --peer vllm-router``.

The peer is started against the same emulated backends as the proxy under test,
driven by the same load, and measured the same way (its process tree's CPU), so
lowproxy's figures can be quoted as ratios to it, in the same invocation, on the
same noisy machine. vllm-router (``pip install vllm-router``: the Rust router of
the vLLM project, PD mode with --vllm-pd-disaggregation) is the one known peer;
when it is not installed the bench says so and runs without it.
"""

from __future__ import annotations

import os
import shutil
import sys

from load_procs import Backends, ProxyProcess, free_port

PEERS = ("vllm-router",)
# The scenarios a peer runs: those with a PD request cycle it can serve.
PEER_SCENARIOS = ("chat", "mooncake", "stream", "latency", "trickle")


def peer_binary(name: str) -> str | None:
    """The peer's executable: beside this Python (a venv) first, then on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which(name)


def available(name: str) -> str | None:
    """Why the peer cannot run (a message to print), or None when it can."""
    if name not in PEERS:
        return f"--peer {name!r}: unknown peer (known: {', '.join(PEERS)})"
    if peer_binary(name) is None:
        return f"--peer {name}: not installed (pip install {name}); running without it"
    return None


def vllm_router_command(binary: str, backends: Backends, kv_protocol: str,
                        port: int) -> list[str]:
    """vllm-router in PD mode on ``port``: round robin over the one prefill and the one
    decode (nothing to balance), its Prometheus listener on a free port of its own
    (the default one is shared by every router on the machine), logging at warning."""
    command = [binary, "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--vllm-pd-disaggregation", "--policy", "round_robin",
               "--log-level", "warning"]
    if kv_protocol == "mooncake":
        command += ["--prefill", backends.prefill_url, str(backends.bootstrap_port),
                    "--kv-connector", "mooncake"]
    else:
        command += ["--prefill", backends.prefill_url]
    return command + ["--decode", backends.decode_url]


class PeerProcess(ProxyProcess):
    """The peer, started like the proxy under test but configured by its own flags."""

    def __init__(self, name: str, backends: Backends, kv_protocol: str) -> None:
        binary = peer_binary(name)
        assert binary is not None, "checked by available()"
        port = free_port()
        super().__init__(vllm_router_command(binary, backends, kv_protocol, port), backends,
                         kv_protocol, "", {}, port=port)
