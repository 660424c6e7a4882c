"""`kvflow bench serve` and `kvflow bench routing`, added under the existing `bench` sub-parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.config import EngineArgs


def register_bench_kinds(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser("serve", help="online latency/throughput against an OpenAI-compatible server")
    serve.add_argument("--base-url", required=True)
    serve.add_argument("--model", default=None, help="default: the server's first model")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--dataset", choices=("random", "prefix-repetition", "shared-prefix"), default="random")
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--input-len", type=int, default=256)
    serve.add_argument("--output-len", type=int, default=64)
    serve.add_argument("--prefix-len", type=int, default=512)
    serve.add_argument("--num-prefixes", type=int, default=8)
    serve.add_argument("--request-rate", type=float, default=float("inf"))
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--goodput", nargs="+", default=None, help="SLOs, e.g. ttft:500 tpot:50 (ms)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--output-json", type=Path, default=None)
    serve.add_argument("--plot", type=Path, default=None, help="PNG of the latency distributions")
    serve.set_defaults(handler=run_serve_bench)

    routing = kinds.add_parser("routing", help="shared-prefix traffic under each routing policy")
    routing.add_argument("--prefill-workers", type=int, default=2)
    routing.add_argument("--decode-workers", type=int, default=1)
    routing.add_argument("--num-prefixes", type=int, default=8)
    routing.add_argument("--prefix-len", type=int, default=512)
    routing.add_argument("--input-len", type=int, default=32)
    routing.add_argument("--output-len", type=int, default=4)
    routing.add_argument("--repeats", type=int, default=4, help="requests per prefix")
    routing.add_argument("--max-concurrency", type=int, default=2)
    routing.add_argument("--output-json", type=Path, default=None)
    EngineArgs.add_cli_args(routing)
    routing.set_defaults(handler=run_routing)


def run_serve_bench(args: argparse.Namespace) -> int:
    import asyncio

    from kvflow.benchmarks.serve import (
        format_report,
        make_prompts,
        parse_goodput,
        plot,
        run_benchmark,
        summarize,
    )

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    goodput = parse_goodput(args.goodput)
    prompts = make_prompts(args.dataset, args.num_prompts, args.input_len, args.prefix_len, args.num_prefixes,
                           args.seed)
    results, duration = asyncio.run(run_benchmark(args.base_url, args.model, prompts, args.output_len,
                                                  args.request_rate, args.max_concurrency, args.api_key, args.seed))
    summary = summarize(results, duration, goodput)
    print(format_report(summary))
    if args.plot is not None:
        plot(summary, args.plot)
    series = summary.pop("_series_ms")
    summary.update(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                   output_len=args.output_len, request_rate=str(args.request_rate),
                   max_concurrency=args.max_concurrency)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({**summary, "ttfts": series["ttft"]}) + "\n")
    return 0


def run_routing(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.routing import run_routing_bench

    results = run_routing_bench(EngineArgs.from_cli_args(args), args.prefill_workers, args.decode_workers,
                                args.num_prefixes, args.prefix_len, args.input_len, args.output_len, args.repeats,
                                args.max_concurrency)
    line = json.dumps(results)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(line + "\n")
    print(line)
    return 0
