"""The demo backends' command line: ``python -m lowproxy.demo`` and ``lowproxy --demo-args``.

One parser for both, so ``--demo-args`` takes exactly the options the demo's
own command takes (``--enable-scale-out``, ``--eos-first``, ...), and a
mistake there names the option.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn, Sequence

from .backend import MODEL
from .handshake import MOONCAKE_LEGACY, NIXL


def parser(kind: type[argparse.ArgumentParser] = argparse.ArgumentParser
           ) -> argparse.ArgumentParser:
    p = kind(
        prog="python -m lowproxy.demo", allow_abbrev=False,
        description="Emulated vLLM 0.33 prefill/decode servers (and SGLang PD), "
                    "strict where vLLM is strict. Prints one JSON line with the URLs.")
    p.add_argument("--role", choices=("pair", "prefill", "decode"), default="pair",
                   help="pair (default): prefill and decode in this process, sharing the KV; "
                        "prefill or decode: one server, for running them as separate processes")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help="port of the single server with --role prefill/decode (0: any free)")
    p.add_argument("--prefill-port", type=int, default=0,
                   help="prefill port with --role pair (0: any free port)")
    p.add_argument("--decode-port", type=int, default=0,
                   help="decode port with --role pair (0: any free port)")
    p.add_argument("--bootstrap-port", type=int, default=0,
                   help="the prefill's Mooncake bootstrap server port (vLLM's "
                        "VLLM_MOONCAKE_BOOTSTRAP_PORT, default there 8998; 0: any free port)")
    p.add_argument("--ranks", type=int, default=1,
                   help="data-parallel ranks (engine ids) the prefill reports on /query")
    p.add_argument("--stream-chunks", type=int, default=None,
                   help="stream exactly this many tokens, whatever the request's cap "
                        "(benchmarks)")
    p.add_argument("--chunk-delay", type=float, default=0.0,
                   help="seconds between streamed tokens (0: as fast as possible)")
    p.add_argument("--kv-wait-timeout", type=float, default=30.0,
                   help="how long a decode waits for its KV before failing the request "
                        "(vLLM 0.30+: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s there); "
                        "a negative value waits for ever, as vLLM 0.16-0.28")
    p.add_argument("--relay-connector", choices=(NIXL, MOONCAKE_LEGACY), default=NIXL,
                   help="what the relay (prefill-then-decode) handshake emulates: NIXL, or "
                        "vLLM 0.13-0.15's Mooncake connector (remote_host/remote_port, "
                        "no block ids)")
    p.add_argument("--flat-block-ids", dest="nested_block_ids", action="store_false",
                   help="NIXL remote_block_ids as one flat list, as before vLLM 0.33 (0.33 "
                   "sends one list per KV-cache group, the default; --nested-block-ids "
                   "is that default)")
    p.add_argument("--nested-block-ids", dest="nested_block_ids", action="store_true",
                   default=True, help=argparse.SUPPRESS)
    p.add_argument("--api-key", default=None,
                   help="as vLLM's --api-key: /v1/... answers 401 without "
                        "'Authorization: Bearer <key>'")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help=f"model names served (several allowed), as vLLM's flag: a request "
                        f"for another model is 404; without it {MODEL} is listed and any "
                        "model name is answered")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="context length reported on /v1/models and enforced")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (chat, "
                        "completions) and cache_read_input_tokens (Messages)")
    p.add_argument("--enable-scale-out", action="store_true",
                   help="serve POST /inference/v1/generate (else 403)")
    p.add_argument("--eos-first", type=float, default=0.0,
                   help="fraction of requests (0..1) whose first generated token is EOS")
    p.add_argument("--block-size", type=int, default=16,
                   help="prefix-cache block size in demo tokens (one per whitespace word)")
    p.add_argument("--prefix-cache-blocks", type=int, default=4096,
                   help="prefix-cache capacity in blocks, per server (0: no prefix cache)")
    p.add_argument("--sglang-pd", action="store_true",
                   help="as SGLang servers started with --disaggregation-mode: the decode "
                        "refuses a request without bootstrap_room (400), --api-key guards "
                        "every path but /health and /metrics, POST /generate is served")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0,
                   help="emulated compute: microseconds per uncached prompt token, one "
                        "request at a time (0: none)")
    p.add_argument("--record", action="store_true",
                   help="keep every request received in memory (tests; off for benchmarks)")
    return p


class _OptionsParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def pair_options(argv: Sequence[str]) -> dict[str, Any]:
    """start_pair()'s arguments from this command line's options (lowproxy --demo-args).

    Raises ValueError, naming the option, for one this parser does not take or
    for --role other than pair: ``lowproxy --demo`` always runs a pair.
    """
    args = parser(_OptionsParser).parse_args(list(argv))
    if args.role != "pair" or args.port is not None:
        raise ValueError("--role and --port are for separate demo processes; --demo runs "
                         "a pair (--prefill-port, --decode-port)")
    return pair_kwargs(args)


def pair_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"host": args.host, "ranks": args.ranks, "stream_chunks": args.stream_chunks,
            "chunk_delay": args.chunk_delay, "record": args.record,
            "ports": (args.prefill_port, args.decode_port),
            "bootstrap_port": args.bootstrap_port, **knobs_of(args)}


def knobs_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"kv_wait_timeout": None if args.kv_wait_timeout < 0 else args.kv_wait_timeout,
            "api_key": args.api_key, "served_model_names": args.served_model_name,
            "max_model_len": args.max_model_len,
            "prompt_tokens_details": args.enable_prompt_tokens_details,
            "scale_out": args.enable_scale_out, "relay_connector": args.relay_connector,
            "nested_block_ids": args.nested_block_ids, "eos_first": args.eos_first,
            "block_size": args.block_size, "prefix_cache_blocks": args.prefix_cache_blocks,
            "sglang_pd": args.sglang_pd,
            "prefill_us_per_token": args.prefill_us_per_token}


__all__ = ["knobs_of", "pair_kwargs", "pair_options", "parser"]
