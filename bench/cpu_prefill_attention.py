"""CPU prefill attention (issue #17): the compiled causal GQA kernel (kernels/cpu/prefill_attention.cpp) against
the torch path it replaces (paged gather + SDPA), SmolLM2-135M shapes (fp32, 9 query heads, 3 KV heads, head_dim
64, block size 16).

1. Per layer: `TorchPagedAttention._attend_cached` (everything attention does after the KV write) for the prefill
   rows of one step, kernel on and off alternating, at B = 8 x L = 128 / 256 / 512, one 2,048-token prompt, and
   prompts continuing a cached prefix (chunked prefill / prefix hits).
2. One engine, the kernel switched on and off between generate calls (alternating): 16 x 512 in / 1 out, i.e.
   exactly one 8,192-token prefill step, fresh random prompts each call (prefix caching off). Same process, same
   weights and memory, so only the attention path differs: the steadiest end-to-end A/B on a noisy box.
3. End to end: `kvflow bench throughput`, 64 x 128 in / 128 out and the prefill-heavy 32 x 512 in / 1 out, in
   separate processes with KVFLOW_CPU_PREFILL_ATTENTION=0 (old) and 1 (new), alternating, each run preceded by a
   wait for the 1-minute load average to settle (the dev box is a shared 2-core VM) and recorded with it.

    python -m bench.cpu_prefill_attention                    # all parts -> bench/results/cpu_prefill_attention.json
    python -m bench.cpu_prefill_attention --skip-throughput  # parts 1 and 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness.records import RESULTS, write_json
from bench.harness.runs import bench_throughput_cli, timed_generate
from engine.runner.attention import AttentionBatch, TorchPagedAttention
from kernels.cpu_prefill_attention import SWITCH_ENV
from kvflow.benchmarks.throughput import host_context, random_prompts

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# name: (query lengths, cached prefix lengths)
LAYER_CASES: dict[str, tuple[list[int], list[int]]] = {
    "B8_L128": ([128] * 8, [0] * 8),
    "B8_L256": ([256] * 8, [0] * 8),
    "B8_L512": ([512] * 8, [0] * 8),
    "B1_L2048": ([2048], [0]),
    "B8_256_after_256_cached": ([256] * 8, [256] * 8),
    "B1_512_after_1536_cached": ([512], [1536]),
    "B4_ragged_fresh_100_300_37_512": ([100, 300, 37, 512], [0] * 4),
    "B64_L128": ([128] * 64, [0] * 64),  # the prefill step of the 64 x 128 / 128 throughput run
    "B16_L512": ([512] * 16, [0] * 16),  # each of the two prefill steps of the 32 x 512 / 1 run
    "B8_4_after_508_cached": ([4] * 8, [508] * 8),  # speculative-decoding verify rows, tiny chunks
    "B64_8_after_120_cached": ([8] * 64, [120] * 64),
}
THROUGHPUT = {
    "64x128in_128out": ["--num-prompts", "64", "--input-len", "128", "--output-len", "128", "--ignore-eos"],
    "32x512in_1out": ["--num-prompts", "32", "--input-len", "512", "--output-len", "1", "--ignore-eos"],
}
MODEL = ["--model", "smollm2", "--dtype", "float32"]


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def layer_case(query_lens: list[int], cached: list[int]) -> tuple[Any, ...]:
    """Queries (a view into a fused qkv, as the engine passes them), a paged cache in shuffled blocks holding
    every sequence's context, the batch, and the attention FLOPs."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    per_seq = [(s + BLOCK - 1) // BLOCK for s in seq_lens]
    caches = [torch.randn(sum(per_seq) + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2)]  # K, V
    tables = [t.tolist() for t in (torch.randperm(sum(per_seq), generator=gen) + 1).split(per_seq)]  # never block 0
    slots = [table[t // BLOCK] * BLOCK + t % BLOCK for table, c, s in zip(tables, cached, seq_lens, strict=True)
             for t in range(c, s)]
    qkv = torch.randn(sum(query_lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
    flops = sum(4 * HEADS * HEAD_DIM * (n * (n + 1) // 2 + c * n) for n, c in zip(query_lens, cached, strict=True))
    return q, tuple(caches), AttentionBatch(query_lens, seq_lens, tables, slots), flops


def one_layer_case(arms: dict[str, TorchPagedAttention], query_lens: list[int], cached: list[int],
                   rounds: int) -> dict[str, Any]:
    q, kv, batch, flops = layer_case(query_lens, cached)
    meta = arms["new_kernel_ms"].build_metadata(batch, torch.device("cpu"))
    scale = HEAD_DIM ** -0.5
    outs = {arm: backend._attend_cached(q, kv, meta, scale) for arm, backend in arms.items()}  # warm-up
    error = ((outs["new_kernel_ms"] - outs["old_sdpa_ms"]).norm() / outs["old_sdpa_ms"].norm()).item()
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    loads = []
    for _ in range(rounds):  # alternating, so drift on the shared box hits both arms alike
        loads.append(load_1m())
        for arm, backend in arms.items():
            start = time.perf_counter()
            backend._attend_cached(q, kv, meta, scale)
            times[arm].append(round((time.perf_counter() - start) * 1e3, 3))
    row: dict[str, Any] = {arm: statistics.median(samples) for arm, samples in times.items()}
    row["speedup"] = round(row["old_sdpa_ms"] / row["new_kernel_ms"], 2)
    row["gflop_s_old"] = round(flops / row["old_sdpa_ms"] / 1e6, 1)
    row["gflop_s_new"] = round(flops / row["new_kernel_ms"] / 1e6, 1)
    row["rel_diff_vs_sdpa"] = float(f"{error:.2e}")
    row["samples_ms"] = times
    row["load_1m"] = [min(loads), max(loads)]
    return row


def bench_layers(rounds: int) -> dict[str, Any]:
    new = TorchPagedAttention(BLOCK)
    if new.cpu_prefill_kernel is None:
        raise RuntimeError(f"the prefill kernel is not built (or {SWITCH_ENV}=0): nothing to compare")
    old = TorchPagedAttention(BLOCK)
    old.cpu_prefill_kernel = None
    results: dict[str, Any] = {}
    for name, (query_lens, cached) in LAYER_CASES.items():
        row = results[name] = one_layer_case({"old_sdpa_ms": old, "new_kernel_ms": new}, query_lens, cached, rounds)
        print(f"{name:32s} old {row['old_sdpa_ms']:7.2f} ms  new {row['new_kernel_ms']:7.2f} ms  "
              f"x{row['speedup']:.2f}  ({row['gflop_s_old']} -> {row['gflop_s_new']} GFLOP/s, load "
              f"{row['load_1m'][0]}-{row['load_1m'][1]})", flush=True)
    return results


def bench_prefill_step(rounds: int) -> dict[str, Any]:
    from kvflow import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", enable_prefix_caching=False)
    backend = llm.llm_engine.runner.attn_backend
    kernel = getattr(backend, "cpu_prefill_kernel", None)
    if kernel is None:
        raise RuntimeError(f"the prefill kernel is not in use (or {SWITCH_ENV}=0): nothing to compare")
    vocab = llm.llm_engine.config.model.arch.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    llm.generate(random_prompts(16, 512, vocab, seed=999), params)  # warm-up
    times: dict[str, list[float]] = {"old": [], "new": []}
    loads = []
    for i in range(rounds):
        for arm in ("old", "new"):
            backend.cpu_prefill_kernel = kernel if arm == "new" else None
            loads.append(load_1m())
            seconds = timed_generate(llm, random_prompts(16, 512, vocab, seed=2 * i + (arm == "new")), params)[1]
            times[arm].append(round(seconds, 3))
        print(f"prefill step 16 x 512: old {times['old'][-1]} s, new {times['new'][-1]} s (load {loads[-1]})",
              flush=True)
    llm.close()
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    return {"workload": "16 prompts x 512 in / 1 out = one 8,192-token prefill step per generate call",
            "median_s_old": old, "median_s_new": new, "change": f"{(new / old - 1) * 100:+.1f} %",
            "samples_s": times, "load_1m": [min(loads), max(loads)]}


def settle(max_load: float, max_wait_s: float) -> float:
    waited = 0.0
    while load_1m() > max_load and waited < max_wait_s:
        time.sleep(5)
        waited += 5
    return load_1m()


def bench_throughput(repeats: int, max_load: float, max_wait_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for workload, flags in THROUGHPUT.items():
        runs: list[dict[str, Any]] = []
        for _ in range(repeats):
            for arm, switch in (("old", "0"), ("new", "1")):
                load = settle(max_load, max_wait_s)
                run = bench_throughput_cli(*MODEL, *flags, env={**os.environ, SWITCH_ENV: switch})
                runs.append({"arm": arm, "load_1m_before": load, "output_tok_s": run["output_tok_s"],
                             "total_tok_s": run["total_tok_s"], "elapsed_s": run["elapsed_s"]})
                print(f"{workload} {arm}: {run['total_tok_s']} total tok/s, {run['output_tok_s']} out tok/s "
                      f"(load before {load})", flush=True)
        medians = {f"median_{key}_{arm}": statistics.median(r[key] for r in runs if r["arm"] == arm)
                   for key in ("total_tok_s", "output_tok_s") for arm in ("old", "new")}
        results[workload] = {
            "command": " ".join(["kvflow", "--log-level", "WARNING", "bench", "throughput", *MODEL, *flags])
            + f"  # with {SWITCH_ENV}=0 (old) / 1 (new)", "runs": runs, **medians}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="alternating timing rounds per layer case")
    parser.add_argument("--step-rounds", type=int, default=4, help="alternating in-process prefill-step rounds")
    parser.add_argument("--repeats", type=int, default=2, help="throughput runs per arm and workload")
    parser.add_argument("--settle-load", type=float, default=1.0)
    parser.add_argument("--settle-max-s", type=float, default=60.0)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_prefill_attention.json")
    args = parser.parse_args()
    if min(args.rounds, args.step_rounds, args.repeats) < 1:
        raise ValueError("--rounds, --step-rounds and --repeats must be at least 1")
    result: dict[str, Any] = {
        "what": "CPU prefill attention: compiled causal GQA kernel (new) vs paged gather + torch SDPA (old)",
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK,
                   "dtype": "float32"},
        "switch": f"{SWITCH_ENV}=0 keeps the old path",
        "context": {**host_context(), "threads": torch.get_num_threads(),
                    "ld_preload": os.environ.get("LD_PRELOAD", "")},
        "command": "python -m bench.cpu_prefill_attention " + " ".join(sys.argv[1:]),
        "per_layer": bench_layers(args.rounds),
        "prefill_step_in_process": bench_prefill_step(args.step_rounds),
    }
    if not args.skip_throughput:
        result["throughput"] = bench_throughput(args.repeats, args.settle_load, args.settle_max_s)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
