"""`kvflow bench throughput ...` (offline engine throughput), `kvflow bench startup` (time to answer, peak memory)
and the serving benchmarks (kvflow/commands/bench_serving.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

from engine.arg_utils import EngineArgs


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    tp = kinds.add_parser("throughput", help="offline throughput on random-token prompts")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--ignore-eos", action="store_true")
    tp.add_argument("--dataset-seed", type=int, default=0)
    tp.add_argument("--output-json", type=Path, default=None)
    EngineArgs.add_cli_args(tp)
    tp.set_defaults(handler=run_throughput_command)
    startup = kinds.add_parser("startup", help="seconds until `kvflow serve` answers, and its processes' peak memory",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    startup.add_argument("--model", default="smollm2", help="the model `kvflow serve` loads")
    startup.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for health and each answer")
    startup.add_argument("--log", type=Path, default=Path("kvflow-bench-startup.log"), help="the server's log")
    startup.add_argument("--output-json", type=Path, default=None, help="also write the record here")
    startup.add_argument("serve_flags", nargs=argparse.REMAINDER,
                         help="more `kvflow serve` flags, after `--` (e.g. -- --index memory)")
    startup.set_defaults(handler=run_startup_command)
    from kvflow.commands.bench_serving import register_bench_kinds

    register_bench_kinds(kinds)


def run_startup_command(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.startup import format_line, run_startup, to_json

    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    flags = [flag for flag in args.serve_flags if flag != "--"]
    try:
        record = run_startup(args.model, flags, args.timeout, args.log)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:  # the server's own error, with its log's tail
        print(f"kvflow: error: kvflow serve did not answer: {exc}", file=sys.stderr)
        return 1
    print(format_line(record))
    print(to_json(record))
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(to_json(record) + "\n")
    return 0


def run_throughput_command(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.throughput import format_line, run_throughput, to_json

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    result, context = run_throughput(EngineArgs.from_cli_args(args), args.num_prompts, args.input_len,
                                     args.output_len, args.ignore_eos, args.dataset_seed)
    line = to_json(result, context)
    print(format_line(result))
    print(line)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(line + "\n")
    return 0
