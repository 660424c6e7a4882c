"""`kvflow bench serve`, `kvflow bench routing` and `kvflow bench multiturn`, added under the existing `bench`
sub-parser."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from engine.arg_utils import EngineArgs


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
    _register_multiturn(kinds)

    pd_bench = kinds.add_parser("pd", help="P/D cost per request: TTFT disaggregated vs local, KV transfer GB/s")
    pd_bench.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096])
    pd_bench.add_argument("--reps", type=int, default=5)
    pd_bench.add_argument("--output-len", type=int, default=4)
    pd_bench.add_argument("--kv-transfer-backend", choices=("auto", "nccl", "grpc"), default="auto")
    pd_bench.add_argument("--prefill-gpus", type=int, nargs=1, default=None)
    pd_bench.add_argument("--decode-gpus", type=int, nargs=1, default=None)
    pd_bench.add_argument("--output-json", type=Path, default=None, help="a JSON list of the records")
    EngineArgs.add_cli_args(pd_bench)
    pd_bench.set_defaults(handler=run_pd, gpu_memory_utilization=None)


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


def run_pd(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.pd import run_pd_bench
    from kvflow.launcher import DEFAULT_GPU_MEMORY_UTILIZATION

    if args.reps < 1 or args.output_len < 1 or min(args.prompt_lens) < 1:
        raise ValueError("--reps, --output-len and --prompt-lens must be >= 1")
    share = args.gpu_memory_utilization
    args.gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION if share is None else share
    records = run_pd_bench(EngineArgs.from_cli_args(args), args.prompt_lens, args.reps, args.output_len,
                           args.kv_transfer_backend,
                           tuple(args.prefill_gpus) if args.prefill_gpus else None,
                           tuple(args.decode_gpus) if args.decode_gpus else None, share)
    for record in records:
        print(f"{record['prompt_tokens']:>6} tokens: TTFT disaggregated {record['ttft_disagg_s'] * 1e3:.1f} ms vs "
              f"local {record['ttft_local_s'] * 1e3:.1f} ms ({record['ttft_ratio']:.2f}x); transfer "
              f"{record['transfer_ms']:.2f} ms, {record['transfer_gbps'] or 0:.1f} GB/s "
              f"({record['transfer_share_of_ttft']:.1%} of TTFT) over {record['kv_transfer_backend']}")
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


def _register_multiturn(kinds: argparse._SubParsersAction) -> None:
    from kvflow.benchmarks.multiturn_workload import MODES, Workload

    multiturn = kinds.add_parser("multiturn", help="multi-turn conversations: no tier, host KV tier, round-robin")
    defaults = Workload()
    for field in dataclasses.fields(Workload):
        multiturn.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=getattr(defaults, field.name))
    multiturn.add_argument("--prefill-workers", type=int, default=2)
    multiturn.add_argument("--decode-workers", type=int, default=1)
    multiturn.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    multiturn.add_argument("--output-json", type=Path, default=None, help="e.g. bench/results/kv_tiers_cpu.json")
    EngineArgs.add_cli_args(multiturn)
    multiturn.set_defaults(handler=run_multiturn)


def run_multiturn(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.multiturn import run_multiturn_bench
    from kvflow.benchmarks.multiturn_workload import Workload

    workload = Workload(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Workload)})
    records = run_multiturn_bench(EngineArgs.from_cli_args(args), workload, args.prefill_workers,
                                  args.decode_workers, tuple(args.modes))
    for r in records:
        print(f"{r['mode']:>12}: TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms, p99 {r['ttft_p99_s'] * 1e3:.1f} ms; prefix "
              f"hits {r['prefix_hit_rate']['total']:.1%} (host {r['prefix_hit_rate']['host']:.1%}); false hits "
              f"{r['false_hits']}; ITL p99 {r['itl_p99_s'] * 1e3:.1f} ms; {r['out_tok_s']:.1f} out tok/s "
              f"({r['completed']} ok, {r['failed']} failed)")
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(records, indent=1) + "\n")
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
