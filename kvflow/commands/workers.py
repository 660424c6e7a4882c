"""`kvflow worker`, `kvflow prefill` and `kvflow decode`: one worker per process, vLLM engine arguments.

`kvflow worker` is role-free: it serves both `Prefill` and `Generation`, and the router decides per request which
role it plays (its pool, which the router's planner may change). `kvflow prefill` / `kvflow decode` pin a worker to
one role for operators who want a fixed split; the router never moves a pinned worker."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.arg_utils import EngineArgs

if TYPE_CHECKING:
    import grpc

    from cluster.worker.runtime import WorkerContext


def register(subparsers: argparse._SubParsersAction) -> None:
    from cluster.worker.args import add_worker_args

    prefill = subparsers.add_parser("prefill", help="run a prefill worker (gRPC Prefill service)")
    add_worker_args(prefill)
    EngineArgs.add_cli_args(prefill, default_log_stats=True)  # servers log vLLM's stats line by default
    prefill.set_defaults(handler=run_prefill)

    decode = subparsers.add_parser("decode", help="run a decode worker (gRPC Generation service)")
    _add_decode_args(decode)
    decode.set_defaults(handler=run_decode)

    worker = subparsers.add_parser("worker", help="run a role-free worker (Prefill and Generation services; the "
                                                  "router picks its role per request)")
    _add_decode_args(worker)
    worker.set_defaults(handler=run_worker)


def _add_decode_args(parser: argparse.ArgumentParser) -> None:
    from cluster.worker.args import add_worker_args

    add_worker_args(parser)
    parser.add_argument("--disagg-min-prompt-tokens", type=int, default=0,
                        help="prefill locally when fewer prompt tokens than this miss the prefix cache "
                             "(0: always use the prefill worker when the router names one)")
    parser.add_argument("--prefill-allowlist", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                        help="prefill workers this worker may pull KV from (and send its cluster credential to): "
                             "host:port, or a DNS name:port allowing every IP it resolves to (e.g. a headless "
                             "Service); other prefill addresses are prefilled locally. Unset: any address without "
                             "a cluster token, none with one")
    EngineArgs.add_cli_args(parser, default_log_stats=True)


def run_prefill(args: argparse.Namespace) -> int:
    from cluster.worker.runtime import serve_worker
    from prefill_worker.server import add_prefill_servicer

    asyncio.run(serve_worker(args, "prefill", add_prefill_servicer))
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from cluster.worker.runtime import serve_worker

    add_generation = _generation_servicer(args)
    asyncio.run(serve_worker(args, "decode", add_generation))
    return 0


def run_worker(args: argparse.Namespace) -> int:
    from cluster.worker.runtime import serve_worker
    from prefill_worker.server import add_prefill_servicer

    add_generation = _generation_servicer(args)

    def add_both(server: grpc.aio.Server, ctx: WorkerContext) -> None:
        add_prefill_servicer(server, ctx)
        add_generation(server, ctx)

    asyncio.run(serve_worker(args, "worker", add_both))
    return 0


def _generation_servicer(args: argparse.Namespace) -> Callable[[grpc.aio.Server, WorkerContext], object]:
    """The Generation servicer's registration, its flags checked before the model loads (a bad one fails at once)."""
    from decode_worker.allowlist import split_host_port
    from decode_worker.server import add_generation_servicer

    if args.disagg_min_prompt_tokens < 0:
        raise ValueError("--disagg-min-prompt-tokens must be >= 0")
    minimum, allowlist = args.disagg_min_prompt_tokens, tuple(args.prefill_allowlist)
    for entry in allowlist:
        split_host_port(entry)
    return lambda server, ctx: add_generation_servicer(server, ctx, minimum, allowlist)
