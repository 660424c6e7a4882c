"""`kvflow bench throughput ...` (offline engine throughput)."""

from __future__ import annotations

import argparse
from pathlib import Path

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
    from kvflow.commands.bench_serving import register_bench_kinds

    register_bench_kinds(kinds)


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
