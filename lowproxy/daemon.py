"""The daemon: configuration, event loop, listeners, signals, workers.

SIGTERM or SIGINT starts a drain: the listener closes, /readyz answers 503,
requests in flight get PD_PROXY_DRAIN_SECONDS to finish, then what remains is
closed and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import sys
import zipimport
from importlib import metadata
from typing import Any, Callable

import h11
import httpcore

from . import __version__, logs
from .config import Config, ConfigError, load_config, parse_endpoint
from .demo import start_pair
from .proxy import Proxy
from .server import HttpServer, Limits
from .tls import TrustUnavailable

try:  # the optional fast event loop (pip install 'lowproxy[fast]')
    import uvloop

    UVLOOP_FACTORY: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:
    UVLOOP_FACTORY = None

log = logging.getLogger("lowproxy")


def version_text() -> str:
    parts = [f"lowproxy {__version__}", f"h11 {h11.__version__}",
             f"httpcore {httpcore.__version__}"]
    # anyio (httpcore's asyncio extra) has no __version__; the distribution
    # metadata has it, also inside the single-file build (lowproxy.pack).
    try:
        parts.append(f"anyio {metadata.version('anyio')}")
    except metadata.PackageNotFoundError:
        pass
    parts.append(f"python {sys.version.split()[0]}")
    if isinstance(globals().get("__loader__"), zipimport.zipimporter):
        parts.append("single file")  # running from the lowproxy.pack zipapp
    return ", ".join(parts)


def limits_of(config: Config) -> Limits:
    return Limits(max_header_bytes=config.max_header_bytes, max_body_bytes=config.max_body_bytes,
                  header_timeout=config.header_timeout,
                  keepalive_timeout=config.keepalive_timeout,
                  max_connections=config.max_connections)


async def serve(config: Config, sock: socket.socket | None = None,
                ready: asyncio.Future[int] | None = None) -> int:
    """Run one proxy process until a signal drains it; return the exit status."""
    demo = None
    if config.demo:
        demo = await start_pair()
        config = dataclasses.replace(
            config, prefill=(parse_endpoint(demo[0].url + f"#bootstrap_port="
                                            f"{demo[0].bootstrap_port}"),),
            decode=(parse_endpoint(demo[1].url),))
    try:
        proxy = Proxy(config)
    except TrustUnavailable as exc:
        log.error("cannot start: %s", exc)
        return 1
    await proxy.start()
    server = HttpServer(proxy.handle, limits_of(config),
                        on_connections=lambda n: proxy.metrics.client_connections.add(n))
    await server.listen(config.host, config.port, sock=sock, reuse_port=config.workers > 1)
    metrics_server = None
    if config.metrics_port:
        metrics_server = HttpServer(proxy.handle_probes_only, Limits(max_connections=64))
        await metrics_server.listen(config.host, config.metrics_port,
                                    reuse_port=config.workers > 1)
    port = server.ports[0]
    log.info("lowproxy %s listening on %s:%d (handshake=%s, prefill=%s, decode=%s)",
             __version__, config.host, port, config.kv_protocol,
             ",".join(e.label for e in config.prefill) or "none",
             ",".join(e.label for e in config.decode) or "none")
    if not config.decode:
        log.warning("PD_PROXY_DECODE_URL is empty: proxied requests will get %d",
                    config.no_decode_status)
    if ready is not None:
        ready.set_result(port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            log.warning("second signal: exiting at once")
            os._exit(1)
        log.info("signal %d: draining for up to %gs", signum, config.drain_seconds)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await stop.wait()
        proxy.draining = True  # /readyz answers 503 from here on
        await server.drain(config.drain_seconds)
        if metrics_server is not None:
            await metrics_server.drain(0)
        await proxy.close(grace=1.0)
        if demo is not None:
            for backend in demo:
                await backend.close()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    log.info("drained; exiting")
    return 0


def _run(config: Config, sock: socket.socket | None = None) -> int:
    """Run serve() on the configured event loop."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if config.loop in ("auto", "uvloop"):
        if UVLOOP_FACTORY is not None:
            loop_factory = UVLOOP_FACTORY
        elif config.loop == "uvloop":
            print("lowproxy: PD_PROXY_LOOP: uvloop is not installed "
                  "(pip install 'lowproxy[fast]')", file=sys.stderr)
            return 2
    loop = loop_factory()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(serve(config, sock))
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _die_with(parent: int) -> None:
    """Make a worker get SIGTERM when its parent dies (Linux), so none is orphaned."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's signal forwarding remains
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _run_workers(config: Config) -> int:
    """N processes, each with its own SO_REUSEPORT socket on the same port.

    The kernel spreads new connections over the sockets. The parent binds the
    first socket (so port 0 resolves to one port for all), hands it to worker
    0, forwards SIGTERM/SIGINT and exits when every worker has.
    """
    first = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET,
                          socket.SOCK_STREAM)
    first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    first.bind((config.host, config.port))
    port = first.getsockname()[1]
    config = dataclasses.replace(config, port=port)
    children = []
    parent = os.getpid()
    for index in range(config.workers):
        pid = os.fork()
        if pid == 0:
            _die_with(parent)
            try:
                if index == 0:
                    first.listen(2048)
                    status = _run(config, sock=first)
                else:
                    first.close()
                    status = _run(config)
            except BaseException:
                logging.getLogger("lowproxy").exception("worker failed")
                status = 1
            os._exit(status)
        children.append(pid)
    first.close()
    log.info("started %d workers on port %d", config.workers, port)

    def forward(signum: int, _frame: Any) -> None:
        for child in children:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    for child in children:
        _, code = os.waitpid(child, 0)
        status = status or os.waitstatus_to_exitcode(code)
    return 0 if status == 0 else 1


def main(argv: list[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ConfigError as exc:
        print(f"lowproxy: {exc}", file=sys.stderr)
        return 2
    if args.version:
        print(version_text())
        return 0
    logs.configure(config.log_level, config.log_format)
    if config.workers > 1:
        return _run_workers(config)
    return _run(config)
