"""`kvflow prefill ...` and `kvflow decode ...`: one disaggregated worker per process, vLLM engine arguments."""

from __future__ import annotations

import argparse
import asyncio

from engine.arg_utils import EngineArgs


def register(subparsers: argparse._SubParsersAction) -> None:
    from cluster.worker.args import add_worker_args

    prefill = subparsers.add_parser("prefill", help="run a prefill worker (gRPC Prefill service)")
    add_worker_args(prefill)
    EngineArgs.add_cli_args(prefill, default_log_stats=True)  # servers log vLLM's stats line by default
    prefill.set_defaults(handler=run_prefill)

    decode = subparsers.add_parser("decode", help="run a decode worker (gRPC Generation service)")
    add_worker_args(decode)
    decode.add_argument("--disagg-min-prompt-tokens", type=int, default=0,
                        help="prefill locally when fewer prompt tokens than this miss the prefix cache "
                             "(0: always use the prefill worker when the router names one)")
    decode.add_argument("--prefill-allowlist", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                        help="prefill workers this worker may pull KV from (and send its cluster credential to): "
                             "host:port, or a DNS name:port allowing every IP it resolves to (e.g. a headless "
                             "Service); other prefill addresses are prefilled locally. Unset: any address without "
                             "a cluster token, none with one")
    EngineArgs.add_cli_args(decode, default_log_stats=True)
    decode.set_defaults(handler=run_decode)


def run_prefill(args: argparse.Namespace) -> int:
    from cluster.worker.runtime import serve_worker
    from prefill_worker.server import add_prefill_servicer

    asyncio.run(serve_worker(args, "prefill", add_prefill_servicer))
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from cluster.worker.runtime import serve_worker
    from decode_worker.allowlist import split_host_port
    from decode_worker.server import add_generation_servicer

    if args.disagg_min_prompt_tokens < 0:
        raise ValueError("--disagg-min-prompt-tokens must be >= 0")
    minimum, allowlist = args.disagg_min_prompt_tokens, tuple(args.prefill_allowlist)
    for entry in allowlist:
        split_host_port(entry)  # before the model loads: a bad entry fails at once
    asyncio.run(serve_worker(args, "decode",
                             lambda server, ctx: add_generation_servicer(server, ctx, minimum, allowlist)))
    return 0
