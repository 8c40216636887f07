"""The daemon: configuration, start-up checks, event loop, listeners, signals.

Everything that can be wrong at start (a port in use, an address that cannot
be bound, an unusable certificate or CA file) stops the start with one line
and exit status 2, before any worker exists. The listening sockets are bound
here, once, and inherited by the workers (workers.py).

SIGTERM or SIGINT starts a drain: the listener closes, /readyz answers 503,
requests in flight get PD_PROXY_DRAIN_SECONDS to finish, then what remains is
closed and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import zipimport
from importlib import metadata
from typing import Callable, Mapping

import h11
import httpcore

from . import __version__
from .config.flags import SHORT_USAGE
from .config.settings import (
    SETTINGS,
    Config,
    ConfigError,
    load_config,
    parse_endpoint,
    setting_name,
)
from .demo.backend import start_pair
from .demo.options import pair_options
from .downstream.server import HttpServer, Limits
from .observability import logs
from .observability.share import MetricsShare, mark_dead
from .proxy.handler import Proxy
from .tls import ServerCertificate, TrustStore, TrustUnavailable
from .workers import Supervisor

try:  # the optional fast event loop (pip install 'lowproxy[fast]')
    import uvloop

    UVLOOP_FACTORY: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:
    UVLOOP_FACTORY = None

log = logging.getLogger("lowproxy")
# The probe and metrics listener: a probe or a scrape asks at once and rarely
# reuses its connection, so idle ones go in seconds. With the main port's 30 s
# head and 75 s keep-alive, 64 idle sockets held every slot and the kubelet's
# liveness probe got 503 until the pod restarted.
PROBE_LIMITS = Limits(max_header_bytes=16 * 1024, max_body_bytes=64 * 1024,
                      header_timeout=2.0, keepalive_timeout=5.0, max_connections=256)

# How often a worker writes its metrics for the others, and checks the certificate.
SHARE_SECONDS = 1.0
CERTIFICATE_CHECK_SECONDS = 1.0


class StartError(Exception):
    """A mistake found at start: one line for the operator, exit status 2.

    ``setting``: the one at fault, as the line names it (the JSON line's
    ``setting`` field, as a parse error carries)."""

    def __init__(self, message: str, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


@dataclasses.dataclass
class Listeners:
    main: socket.socket
    metrics: socket.socket | None = None


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
                  tls_handshake_timeout=config.tls_handshake_timeout,
                  keepalive_timeout=config.keepalive_timeout,
                  max_connections=config.max_connections,
                  write_timeout=config.client_write_timeout or None)


async def serve(config: Config, listeners: Listeners, ready: asyncio.Future[int] | None = None,
                share: MetricsShare | None = None, worker: int | None = None) -> int:
    """Run one proxy process until a signal drains it; return the exit status."""
    demo = None
    if config.demo:
        options = pair_options(config.demo_args)  # checked at start
        # Under sglang the demo is strict as SGLang's PD servers are (a decode
        # leg without bootstrap_room is refused), so the demo shows what they accept.
        options["sglang_pd"] = options["sglang_pd"] or config.kv_protocol == "sglang"
        try:
            demo = await start_pair(**options)
        except OSError as exc:  # a demo port taken (--demo-args with fixed ports)
            logs.start_error(f"PD_PROXY_DEMO_ARGS: the demo backends cannot listen: "
                             f"{exc.strerror or exc}", config.log_format == "json",
                             setting="PD_PROXY_DEMO_ARGS")
            return 2
        config = dataclasses.replace(
            config, prefill=(parse_endpoint(demo[0].url + f"#bootstrap_port="
                                            f"{demo[0].bootstrap_port}"),),
            decode=(parse_endpoint(demo[1].url),))
    certificate = server_certificate(config) if config.tls_cert_file else None
    try:  # checked at start already; a file can still break before a worker starts
        proxy = Proxy(config)
        context = certificate.context() if certificate is not None else None
    except TrustUnavailable as exc:
        log.error("cannot start: %s", exc)
        return 2
    if share is not None and worker is not None:
        try:
            proxy.share_with_workers(share.directory, worker)
        except OSError as exc:  # a TMPDIR too long for a Unix socket's path
            logs.start_error(f"TMPDIR: the workers' sockets under {share.directory}: "
                             f"{exc.strerror or exc} (set TMPDIR to a shorter directory)",
                             config.log_format == "json", setting="TMPDIR")
            return 2
    await proxy.start()
    server = HttpServer(proxy.handle, limits_of(config),
                        on_connections=lambda n: proxy.metrics.client_connections.add(n))
    await server.listen(None, 0, sock=listeners.main, ssl=context)
    metrics_server = None
    if listeners.metrics is not None:  # plain HTTP always: probes and scrapers
        metrics_server = HttpServer(proxy.handle_probes_only, PROBE_LIMITS)
        await metrics_server.listen(None, 0, sock=listeners.metrics)
    background = []
    if share is not None:
        proxy.metrics.peers = share.peers
        background.append(_every(SHARE_SECONDS, lambda: share.write(proxy.metrics.snapshot())))
    if certificate is not None:
        background.append(_every(CERTIFICATE_CHECK_SECONDS,
                                 lambda: _renew(certificate, server)))
    _log_listening(config, server.ports[0], context is not None, worker)
    if ready is not None:
        ready.set_result(server.ports[0])
    await _until_signal(config)
    proxy.draining = True  # /readyz answers 503 from here on
    for task in background:
        task.cancel()
    cut = await server.drain(config.drain_seconds)
    if cut:
        log.warning("drain deadline (%gs, PD_PROXY_DRAIN_SECONDS) cut %d request(s) still "
                    "in flight", config.drain_seconds, cut)
    if metrics_server is not None:
        await metrics_server.drain(0)
    await proxy.close(grace=1.0)
    if share is not None:
        share.write(proxy.metrics.snapshot())  # the last counts of this worker
    if demo is not None:
        for backend in demo:
            await backend.close()
    log.info("drained; exiting")
    return 0


def _log_listening(config: Config, port: int, tls: bool, worker: int | None) -> None:
    log.info("lowproxy %s listening on %s:%d (%s%shandshake=%s, prefill=%s, decode=%s)",
             __version__, config.host, port, "https, " if tls else "",
             f"worker {worker}, " if worker is not None else "", config.kv_protocol,
             ",".join(e.label for e in config.prefill) or "none",
             ",".join(e.label for e in config.decode) or "none")
    if not config.decode:
        log.warning("PD_PROXY_DECODE_URL is empty: proxied requests will get %d",
                    config.no_decode_status)


async def _until_signal(config: Config) -> None:
    """Return on the first SIGTERM/SIGINT; a second one, during the drain, exits at once."""
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

    # The handlers stay for the drain; the loop closes with the process.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    # A worker starts with them blocked (workers.py); one that came meanwhile lands now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    await stop.wait()


def _every(seconds: float, action: Callable[[], object]) -> asyncio.Task[None]:
    async def repeat() -> None:
        while True:
            await asyncio.sleep(seconds)
            result = action()
            if asyncio.iscoroutine(result):
                await result

    return asyncio.get_running_loop().create_task(repeat())


async def _renew(certificate: ServerCertificate, server: HttpServer) -> None:
    """A renewed certificate (or client CA) serves new connections; a broken one does not."""
    if not certificate.changed():
        return
    try:
        context = certificate.context()
    except TrustUnavailable as exc:
        log.warning("TLS files changed but cannot be used, keeping the previous ones: %s", exc)
        return
    await server.use_tls(context)
    log.info("TLS certificate reloaded from %s", certificate.cert_file)


def _run(config: Config, listeners: Listeners, share: MetricsShare | None = None,
         worker: int | None = None) -> int:
    """Run serve() on the configured event loop."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if config.loop in ("auto", "uvloop") and UVLOOP_FACTORY is not None:
        loop_factory = UVLOOP_FACTORY  # (uvloop asked for and missing: check_start)
    loop = loop_factory()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(serve(config, listeners, share=share, worker=worker))
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _run_workers(config: Config, listeners: Listeners) -> int:
    """N workers serving the sockets bound here, their metrics shared through files."""
    directory = tempfile.mkdtemp(prefix="lowproxy-metrics-")
    port = listeners.main.getsockname()[1]
    config = dataclasses.replace(config, port=port)

    def run_worker(index: int, seq: int) -> int:
        logs.configure(config.log_level, config.log_format, worker=index)  # in the fork
        return _run(config, listeners, MetricsShare(directory, seq), worker=index)

    def stop_listening() -> None:
        # The workers' copies close as they drain; this one too, or the port stays
        # in LISTEN and a connection made during the drain hangs, then is reset.
        # The metrics port stays up through the drain (probes).
        listeners.main.close()

    supervisor = Supervisor(config.workers, run_worker, lambda seq: mark_dead(directory, seq),
                            on_stop=stop_listening)
    try:
        status = supervisor.run()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    log.info("%d workers on port %d drained; exiting", config.workers, port)
    return status


# -- start-up checks: each raises StartError with one line


def check_start(config: Config, name: Callable[[str], str] = setting_name()) -> None:
    """Settings that parse but cannot work together, and files that cannot be used.

    ``name(field)`` is how the line names a setting: its flag when that was given."""
    if config.loop == "uvloop" and UVLOOP_FACTORY is None:
        # Here, not in the worker: under --workers each would say it, and exit.
        raise StartError(f"{name('loop')}: uvloop is not installed (pip install "
                         "'lowproxy[fast]')", name('loop'))
    if config.metrics_port and config.metrics_port == config.port:
        raise StartError(f"{name('metrics_port')} {config.metrics_port} is the main port "
                         f"({name('port')}): choose another one", name('metrics_port'))
    if bool(config.tls_cert_file) != bool(config.tls_key_file):
        missing = 'tls_key_file' if config.tls_cert_file else 'tls_cert_file'
        raise StartError(f"{name('tls_cert_file')} and {name('tls_key_file')} go together",
                         name(missing))
    if config.demo_args and not config.demo:
        raise StartError(f"{name('demo_args')} is set, but not --demo", name('demo_args'))
    if config.demo:
        try:
            pair_options(config.demo_args)
        except ValueError as exc:
            raise StartError(f"{name('demo_args')}: {exc}", name('demo_args')) from None
    if config.peers and config.prefill_policy != "cache-aware":
        raise StartError(f"{name('peers')} shares cache-aware prefill choices: it needs "
                         f"{name('prefill_policy')}=cache-aware, not {config.prefill_policy}",
                         name('peers'))
    if config.tls_client_ca_file and not config.tls_cert_file:
        raise StartError(f"{name('tls_client_ca_file')} needs {name('tls_cert_file')} and "
                         f"{name('tls_key_file')} (mTLS is on the HTTPS port)",
                         name('tls_client_ca_file'))
    if config.ca_file:
        try:
            TrustStore(config.ca_file).context()
        except TrustUnavailable as exc:
            raise StartError(f"{name('ca_file')}: {exc}", name('ca_file')) from None
    if config.tls_cert_file:
        try:
            server_certificate(config).context()
        except TrustUnavailable as exc:
            # Which file: the client CA's message names it; else the pair (the
            # ssl module cannot tell a bad key from a bad certificate).
            if str(exc).startswith("client CA"):
                named = setting = name('tls_client_ca_file')
            else:
                setting = name('tls_cert_file')
                named = f"{setting} / {name('tls_key_file')}"
            raise StartError(f"{named}: {exc}", setting) from None


def server_certificate(config: Config) -> ServerCertificate:
    return ServerCertificate(config.tls_cert_file, config.tls_key_file,
                             config.tls_client_ca_file)


def bind(host: str, port: int, setting: str, host_setting: str = "PD_PROXY_HOST"
         ) -> socket.socket:
    """Bind and listen on host:port, without SO_REUSEPORT: the port is ours alone."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a label over 63
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a valid host name"
        raise StartError(f"cannot listen on {host}:{port} ({host_setting}: "
                         f"{reason})", host_setting) from None
    sock = socket.socket(family, kind, proto)
    try:
        # SO_REUSEADDR only lets a restart bind past connections in TIME_WAIT;
        # on Linux it never lets two listeners share a port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            at_fault, reason = setting, f"{setting}: address in use (another process listens there)"
        else:
            at_fault, reason = host_setting, f"{host_setting}: {exc.strerror or exc}"
        raise StartError(f"cannot listen on {host}:{port} ({reason})", at_fault) from None
    sock.set_inheritable(False)
    return sock


def open_listeners(config: Config, name: Callable[[str], str] = setting_name()) -> Listeners:
    main = bind(config.host, config.port, name("port"), name("host"))
    if not config.metrics_port:
        return Listeners(main)
    try:
        return Listeners(main, bind(config.host, config.metrics_port, name("metrics_port"),
                                    name("host")))
    except StartError:
        main.close()
        raise


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """A misspelt PD_PROXY_* variable is otherwise silently ignored."""
    known = [setting.env for setting in SETTINGS]
    for name in sorted(environ):
        if name.startswith("PD_PROXY_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            log.warning("%s is not a lowproxy setting, ignored%s", name, hint)


def warn_peers_with_workers(config: Config) -> None:
    """PD_PROXY_PEERS with --workers: each worker tells the peers and its siblings its
    own choices (routing/worker_share.py), but a peer's batch reaches one worker of each
    replica, which does not pass it on."""
    if config.peers and config.workers > 1:
        log.warning("PD_PROXY_PEERS with %d workers (PD_PROXY_WORKERS): a peer's batch "
                    "reaches one of them, which does not pass it on to the others; run one "
                    "worker per replica for the sharing to cover it", config.workers)


def warn_otel_without_sdk(config: Config) -> None:
    """PD_PROXY_OTEL=1 with only opentelemetry-api: spans would go to the no-op provider."""
    if not config.otel:
        return
    try:
        from opentelemetry import trace
    except ImportError:
        return  # tracing.py says so itself
    if isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider,
                                                trace.NoOpTracerProvider)):
        log.warning("PD_PROXY_OTEL=1 but no OpenTelemetry SDK tracer provider is configured: "
                    "spans go nowhere (run under opentelemetry-instrument with "
                    "opentelemetry-distro and an exporter installed)")


def json_requested(argv: list[str] | None, environ: Mapping[str, str]) -> bool:
    """Whether start errors are JSON lines, read before (or without) a whole Config:
    PD_PROXY_LOG_FORMAT or --log-format as given, whatever else failed to parse."""
    args = sys.argv[1:] if argv is None else argv
    value = environ.get("PD_PROXY_LOG_FORMAT", "")
    for index, arg in enumerate(args):
        if arg == "--log-format" and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith("--log-format="):
            value = arg.partition("=")[2]
    return value.strip().lower() == "json"


def main(argv: list[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ConfigError as exc:
        logs.start_error(str(exc), json_requested(argv, os.environ), setting=exc.setting,
                         usage=SHORT_USAGE if exc.usage else "")
        return 2
    if args.version:
        print(version_text())
        return 0
    logs.configure(config.log_level, config.log_format)
    warn_unknown_variables(os.environ)
    try:
        name = setting_name(args)
        check_start(config, name)
        listeners = open_listeners(config, name)
    except StartError as exc:
        logs.start_error(str(exc), config.log_format == "json", setting=exc.setting)
        return 2
    warn_otel_without_sdk(config)
    warn_peers_with_workers(config)
    try:
        if config.workers > 1:
            return _run_workers(config, listeners)
        return _run(config, listeners)
    finally:
        for sock in (listeners.main, listeners.metrics):
            if sock is not None:
                sock.close()
