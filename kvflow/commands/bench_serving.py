"""`kvflow bench serve`, `routing`, `pd` and `multiturn`, added under the existing `bench` sub-parser."""

from __future__ import annotations

import argparse
import json
import tempfile
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

    pd_bench = kinds.add_parser("pd", help="P/D cost per request: TTFT disaggregated vs local, KV transfer GB/s")
    pd_bench.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096])
    pd_bench.add_argument("--reps", type=int, default=5)
    pd_bench.add_argument("--output-len", type=int, default=4)
    pd_bench.add_argument("--kv-transfer-backend", choices=("auto", "nccl", "grpc"), default="auto")
    pd_bench.add_argument("--prefill-gpus", type=int, nargs=1, default=None)
    pd_bench.add_argument("--decode-gpus", type=int, nargs="+", default=None, help="one per --decode-workers")
    pd_bench.add_argument("--decode-workers", type=int, default=1, help="each measured in turn, --reps times")
    pd_bench.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                          help="the prefill worker's (default: --tensor-parallel-size)")
    pd_bench.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                          help="each decode worker's (default: --tensor-parallel-size)")
    pd_bench.add_argument("--output-json", type=Path, default=None, help="a JSON list of the records")
    EngineArgs.add_cli_args(pd_bench)
    pd_bench.set_defaults(handler=run_pd, gpu_memory_utilization=None)
    _register_multiturn(kinds)


def _register_multiturn(kinds: argparse._SubParsersAction) -> None:
    from kvflow.benchmarks.multiturn import MODES, Workload

    defaults = Workload()
    multiturn = kinds.add_parser("multiturn", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 help="multi-turn conversations over a working set larger than the KV cache, per "
                                      "KV-tier / routing mode")
    multiturn.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    multiturn.add_argument("--conversations", type=int, default=defaults.conversations)
    multiturn.add_argument("--turns", type=int, default=defaults.turns)
    multiturn.add_argument("--system-len", type=int, default=defaults.system_len,
                           help="tokens of the system prompt every conversation shares")
    multiturn.add_argument("--user-len", type=int, default=defaults.user_len, help="new user tokens per turn")
    multiturn.add_argument("--output-len", type=int, default=defaults.output_len, help="answer tokens per turn")
    multiturn.add_argument("--max-concurrency", type=int, default=defaults.max_concurrency)
    multiturn.add_argument("--seed", type=int, default=defaults.seed)
    multiturn.add_argument("--vocab", type=int, default=defaults.vocab, help="prompt ids are drawn below this")
    multiturn.add_argument("--host-tier-gib", type=float, default=1.0,
                           help="--kv-offloading-size of the host_tier modes")
    multiturn.add_argument("--timeout", type=float, default=900.0, help="seconds each server may take to start")
    multiturn.add_argument("--log-dir", type=Path, default=None,
                           help="where each mode's server log goes (default: a new temporary directory, kept and "
                                "named at the end)")
    multiturn.add_argument("--output-json", type=Path, default=None, help="a JSON list of the records")
    multiturn.add_argument("serve_flags", nargs=argparse.REMAINDER,
                           help="`kvflow serve` flags for every mode, after `--` (e.g. -- --model smollm2 -dp 2 "
                                "--kv-cache-memory-bytes 8000000)")
    multiturn.set_defaults(handler=run_multiturn_command)


def run_multiturn_command(args: argparse.Namespace) -> int:
    from kvflow.benchmarks.multiturn import Workload, format_line, run_multiturn

    workload = Workload(args.conversations, args.turns, args.system_len, args.user_len, args.output_len,
                        args.max_concurrency, args.seed, args.vocab)
    if not args.host_tier_gib > 0 or not args.timeout > 0:
        raise ValueError("--host-tier-gib and --timeout must be > 0")
    flags = [flag for flag in args.serve_flags if flag != "--"]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvflow-bench-multiturn-"))
    records = run_multiturn(flags, args.modes, workload, args.host_tier_gib, args.timeout, log_dir)
    print(f"server logs in {log_dir}")
    for record in records:
        print(format_line(record))
    digests = {record["outputs_sha256"] for record in records}
    if len(records) > 1:  # one mode has nothing to agree with
        print("greedy outputs " + ("agree across modes" if len(digests) == 1 else f"DIFFER across modes: {digests}"))
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(records, indent=1) + "\n")
    return 0 if len(digests) == 1 and all(record["failed"] == 0 for record in records) else 1


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
                           tuple(args.decode_gpus) if args.decode_gpus else None, share,
                           prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
                           decode_tensor_parallel_size=args.decode_tensor_parallel_size,
                           decode_workers=args.decode_workers)
    for record in records:
        print(f"{record['prompt_tokens']:>6} tokens: TTFT disaggregated {record['ttft_disagg_s'] * 1e3:.1f} ms vs "
              f"local {record['ttft_local_s'] * 1e3:.1f} ms ({record['ttft_ratio']:.2f}x); transfer "
              f"{record['transfer_ms']:.2f} ms, {record['transfer_gbps'] or 0:.1f} GB/s "
              f"({record['transfer_share_of_ttft']:.1%} of TTFT) over {record['kv_transfer_backend']}")
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
