"""The demo: emulated vLLM and SGLang backends, strict where the engines are strict.

``backend`` is the HTTP server of one emulated engine (``DemoBackend``,
``start_pair``), ``engine`` parses and answers requests, ``kv`` tokenizes and
holds the emulated KV, ``handshake`` the NIXL, Mooncake and SGLang transfers,
``sglang`` what an SGLang PD server refuses and how it runs a batch,
``answers`` and ``wire`` what goes on the wire; ``python -m lowproxy.demo`` runs
them. It imports nothing of the proxy, routing, handshakes or upstream: an
emulator sharing the legs' code would agree with their bugs.
"""

from .backend import MODEL, DemoBackend, Faults, KvRegistry, Received, start_pair

__all__ = ["MODEL", "DemoBackend", "Faults", "KvRegistry", "Received", "start_pair"]
