"""``python -m lowproxy.demo``: emulated vLLM backends without a GPU.

By default one process runs a prefill and a decode sharing an in-memory KV
registry (what bench/load.py starts). ``--role prefill`` or ``--role decode``
runs one server per process; the decode then pulls the emulated KV from the
prefill's bootstrap server over loopback, so the pair can be started apart:

    python -m lowproxy.demo --role prefill --port 8100 --bootstrap-port 8998
    python -m lowproxy.demo --role decode --port 8200

Each prints one JSON line with its URLs once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from typing import Any

from .backend import DemoBackend, start_pair
from .options import knobs_of, pair_kwargs, parser


async def serve(args: argparse.Namespace) -> None:
    knobs = knobs_of(args)
    if args.role == "pair":
        prefill, decode = await start_pair(**pair_kwargs(args))
        info: dict[str, Any] = {"prefill": prefill.url, "decode": decode.url,
                                "bootstrap_port": prefill.bootstrap_port}
    else:
        port = args.port if args.port is not None else (
            args.prefill_port if args.role == "prefill" else args.decode_port)
        backend = DemoBackend(args.role, ranks=args.ranks, stream_chunks=args.stream_chunks,
                              chunk_delay=args.chunk_delay, record=args.record,
                              remote_kv=True, **knobs)
        await backend.start(args.host, port,
                            bootstrap_port=args.bootstrap_port if args.role == "prefill"
                            else None)
        info = {args.role: backend.url}
        if args.role == "prefill":
            info["bootstrap_port"] = backend.bootstrap_port
    # SIGINT and SIGTERM stop it, handled here rather than left to Python's
    # KeyboardInterrupt: a process started from a non-interactive shell's
    # background job inherits SIGINT ignored, and Python then installs no
    # handler, so ^C (or bench/load.py's stop) would be waited out. In before the
    # line that says it listens: whoever reads that line may signal at once.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)
    print(json.dumps(info), flush=True)
    await stop.wait()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:  # a SIGINT before the handlers are in
        pass


if __name__ == "__main__":
    main()
