"""Speculative decoding on a GPU (Llama-3.1-8B shapes, dummy bf16 weights), in one call:

1. verify step vs plain decode step: the runner's whole step (forward, logits, sampling / greedy verification)
   for k + 1 tokens per sequence (k = 1..8 drafts) against one token per sequence (the plain decode step, from
   CUDA graphs as the engine runs it), at batch 1, 8 and 64, context 512. Ratio = verify / decode time.
2. projected batch-1 speedup: mean acceptance length measured on CPU (bench/results/spec_cpu_smollm2.json,
   n-gram k = 4, input-grounded set) / the k = 4 verify-to-decode ratio.
3. concurrency 64 (64 prompts of 128 random tokens, 256 out, greedy, ignore_eos): output tok/s with speculation
   off, n-gram on with disable_by_batch_size=8 (the recommended form), and n-gram on without it; interleaved
   off/on/on-always, twice. The same engine runs all three (its proposer swapped), so nothing else differs.

Parts 0 (the engine path on repetitive prompts: no drafts on random-weight outputs) and 4 (a 2-layer draft model
on the device: a path check) were retired; they run at `git checkout be1a1ae`.

Writes bench/results/spec_gpu_<device>.json. `--smoke` runs the same code on CPU at tiny shapes (tiny-llama).

    PYTHONUNBUFFERED=1 python -m bench.spec_gpu
    python -m bench.spec_gpu --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.harness.records import RESULTS, device_slug, write_json
from bench.harness.runs import output_tokens, spec_counters, timed_generate
from engine.llm_engine import LLMEngine
from engine.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.proposer import NgramProposer
from kvflow.llm import LLM

CONTEXT = 512


@dataclass(frozen=True)
class Sizes:
    model: str
    engine_args: dict[str, Any]
    batches: list[int]
    ks: list[int]
    iters: int
    num_prompts: int
    input_len: int
    output_len: int


SMOKE = Sizes("tiny-llama", dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=1024,
                                 kv_cache_memory_bytes=64 << 20), [1, 8], [1, 2, 4], 3, 8, 32, 16)
FULL = Sizes("llama-3.1-8b", dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
                                  gpu_memory_utilization=0.85), [1, 8, 64], list(range(1, 9)), 20, 64, 128, 256)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(engine: LLMEngine, batch: int, num_drafts: int, iters: int, tag: str) -> float:
    """Median ms of one runner step: `batch` sequences at context CONTEXT, each fed 1 + num_drafts tokens."""
    runner = engine.runner
    bs = engine.config.cache.block_size
    blocks_per_seq = -(-(CONTEXT + num_drafts + 1) // bs)
    if 1 + batch * blocks_per_seq > engine.num_gpu_blocks:
        raise ValueError(f"{batch} x {blocks_per_seq} blocks exceed the {engine.num_gpu_blocks} KV blocks")
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    ids = [f"{tag}-b{batch}-k{num_drafts}-{i}" for i in range(batch)]
    new = [NewRequestData(rid, [1] * CONTEXT, params) for rid in ids]
    chunks = []
    for i, rid in enumerate(ids):
        table = list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        drafts = [(7 * i + j) % 1000 + 3 for j in range(num_drafts)]
        chunks.append(ScheduledChunk(rid, [5, *drafts], CONTEXT, table, True, False, drafts))
    times = []
    runner.decode_ahead.score = float("-inf")  # time single steps, not decode-ahead's pipelined replays
    for it in range(iters + 3):
        so = SchedulerOutput(new if it == 0 else [], chunks, batch * (1 + num_drafts))
        sync(runner.device)
        start = time.perf_counter()
        runner.execute_model(so)  # returns after the step's host sync
        sync(runner.device)
        if it >= 3:
            times.append((time.perf_counter() - start) * 1000)
    runner.execute_model(SchedulerOutput([], [], 0, finished_request_ids=set(ids)))
    return statistics.median(times)


def throughput(llm: LLM, proposer: NgramProposer | None, prompts: list[list[int]], output_len: int
               ) -> dict[str, Any]:
    """Greedy tok/s of `prompts` with `proposer` in the engine, and the drafts it made."""
    engine = llm.llm_engine
    engine.proposer = proposer
    before = spec_counters(engine.stats)
    outs, elapsed = timed_generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                                ignore_eos=True))
    drafts, drafted, accepted = (now - then for now, then in zip(spec_counters(engine.stats), before, strict=True))
    return {"output_tok_s": round(output_tokens(outs) / elapsed, 1), "elapsed_s": round(elapsed, 3),
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted}


def verify_vs_decode(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    verify: dict[str, Any] = {}
    for batch in sizes.batches:
        decode_ms = time_steps(engine, batch, 0, sizes.iters, "decode")
        row: dict[str, Any] = {"decode_ms": round(decode_ms, 3)}
        for k in sizes.ks:
            ms = time_steps(engine, batch, k, sizes.iters, "verify")
            row[f"verify_k{k}_ms"] = round(ms, 3)
            row[f"verify_k{k}_ratio"] = round(ms / decode_ms, 3)
        verify[f"batch_{batch}"] = row
        print(f"batch {batch}: {row}", flush=True)
    return verify


def projection(k4_ratio: float | None) -> dict[str, Any] | None:
    """Part 2: the CPU acceptance lengths over the k = 4 verify ratio at batch 1."""
    cpu = RESULTS / "spec_cpu_smollm2.json"
    if not cpu.is_file() or not k4_ratio:
        return None
    out = {}
    for set_name, result in json.loads(cpu.read_text())["sets"].items():
        length = (result.get("ngram_acceptance") or {}).get("acceptance_length")
        if length:
            out[set_name] = {"cpu_acceptance_length": length, "verify_k4_ratio_batch1": k4_ratio,
                             "projected_speedup": round(length / k4_ratio, 3)}
    print(f"projection: {out}", flush=True)
    return out


def concurrency(llm: LLM, sizes: Sizes) -> dict[str, Any]:
    """Part 3: off vs n-gram (disable_by_batch_size=8) vs n-gram always, interleaved, twice."""
    gen = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.config.model.arch.vocab_size
    prompts = [torch.randint(3, vocab, (sizes.input_len,), generator=gen).tolist() for _ in range(sizes.num_prompts)]
    max_len = llm.llm_engine.config.model.max_model_len
    modes = {"off": None,
             "ngram_disable_by_batch_size_8": NgramProposer(SpecConfig.build("ngram", None, 4, 4, 2, 8), max_len),
             "ngram_always": NgramProposer(SpecConfig.build("ngram", None, 4, 4, 2, None), max_len)}
    throughput(llm, None, prompts[:4], 8)  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(2):
        for mode, proposer in modes.items():
            runs[mode].append(throughput(llm, proposer, prompts, sizes.output_len))
            print(f"concurrency {sizes.num_prompts} {mode}: {runs[mode][-1]}", flush=True)
    best = {m: max(r["output_tok_s"] for r in rs) for m, rs in runs.items()}
    print(json.dumps(best), flush=True)
    return {"num_prompts": sizes.num_prompts, "input_len": sizes.input_len, "output_len": sizes.output_len,
            "runs": runs, "best_output_tok_s": best,
            "slowdown_disable_by_batch_size_8": round(1 - best["ngram_disable_by_batch_size_8"] / best["off"], 4),
            "slowdown_always": round(1 - best["ngram_always"] / best["off"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, small sizes: the same code paths")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    llm = LLM(sizes.model, **sizes.engine_args)
    engine = llm.llm_engine
    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    record: dict[str, Any] = {"device": name, "model": f"{sizes.model} (dummy weights, {engine.config.model.dtype})",
                              "context": CONTEXT, "smoke": args.smoke}
    print(f"device {name}, {engine.num_gpu_blocks} KV blocks", flush=True)
    record["verify_vs_decode"] = verify_vs_decode(engine, sizes)
    proj = projection(record["verify_vs_decode"][f"batch_{sizes.batches[0]}"].get("verify_k4_ratio"))
    if proj is not None:
        record["projected_batch1_speedup_ngram_k4"] = proj
    record["concurrency"] = concurrency(llm, sizes)
    write_json(Path(args.out) if args.out else
               RESULTS / f"spec_gpu_{device_slug(name)}{'_smoke' if args.smoke else ''}.json", record)


if __name__ == "__main__":
    main()
