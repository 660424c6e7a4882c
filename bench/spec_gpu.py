#!/usr/bin/env python3
"""Speculative decoding on a GPU (Llama-3.1-8B shapes, dummy bf16 weights), in one call:

1. verify step vs plain decode step: the runner's whole step (forward, logits, sampling / greedy verification)
   for k + 1 tokens per sequence (k = 1..8 drafts) against one token per sequence (the plain decode step, from
   CUDA graphs as the engine runs it), at batch 1, 8 and 64, context 512. Ratio = verify / decode time.
2. projected batch-1 speedup: mean acceptance length measured on CPU (bench/results/spec_cpu_smollm2.json,
   n-gram k = 4, input-grounded set) / the k = 4 verify-to-decode ratio.
3. concurrency 64 (64 prompts of 128 random tokens, 256 out, greedy, ignore_eos): output tok/s with speculation
   off, n-gram on with disable_by_batch_size=8 (the recommended form), and n-gram on without it; interleaved
   off/on/on-always, twice. The same engine runs all three (its proposer swapped), so nothing else differs.
4. the draft-model proposer on the device (own paged KV, CUDA graphs): a 2-layer truncation drafting for the
   model at batch 1 (dummy weights: a path and timing check, not an acceptance figure).

Writes bench/results/spec_gpu_<device>.json. `--smoke` runs the same code on CPU at tiny shapes (tiny-llama).

    PYTHONUNBUFFERED=1 python3 bench/spec_gpu.py
    python3 bench/spec_gpu.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.outputs import NewRequestData, ScheduledChunk, SchedulerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from engine.spec.proposer import NgramProposer  # noqa: E402
from kvflow.llm import LLM  # noqa: E402

CONTEXT = 512


def _sync(device: torch.device) -> None:
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
        _sync(runner.device)
        start = time.perf_counter()
        runner.execute_model(so)  # returns after the step's host sync
        _sync(runner.device)
        if it >= 3:
            times.append((time.perf_counter() - start) * 1000)
    runner.execute_model(SchedulerOutput([], [], 0, finished_request_ids=set(ids)))
    return statistics.median(times)


def throughput(llm: LLM, proposer: NgramProposer | None, prompts: list[list[int]], output_len: int) -> dict:
    engine = llm.llm_engine
    engine.proposer = proposer
    s = engine.stats
    before = (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tok_s": round(tokens / elapsed, 1), "elapsed_s": round(elapsed, 3),
            "drafts": s.spec_decode_num_drafts - before[0], "draft_tokens": s.spec_decode_num_draft_tokens - before[1],
            "accepted_tokens": s.spec_decode_num_accepted_tokens - before[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, small sizes: the same code paths")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    smoke = args.smoke
    if smoke:
        engine_args: dict[str, Any] = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=1024,
                                           kv_cache_memory_bytes=64 << 20)
        model, batches, ks, iters, n_prompts, in_len, out_len = "tiny-llama", [1, 8], [1, 2, 4], 3, 8, 32, 16
    else:
        engine_args = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
                           gpu_memory_utilization=0.85)
        model, batches, ks, iters, n_prompts, in_len, out_len = "llama-3.1-8b", [1, 8, 64], list(range(1, 9)), 20, \
            64, 128, 256
    llm = LLM(model, **engine_args)
    engine = llm.llm_engine
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record: dict[str, Any] = {"device": name, "model": f"{model} (dummy weights, {engine.config.model.dtype})",
                              "context": CONTEXT, "smoke": smoke}
    print(f"device {name}, {engine.num_gpu_blocks} KV blocks", flush=True)

    # 0. the engine's own speculative path end to end (greedy, batch 1 and 4): repetitive prompts give the n-gram
    # proposer drafts; outputs must equal speculation-off outputs (on a GPU, rows verified in a batch of 8 use
    # other GEMM shapes than single-token decode, so bf16 rounding may let a random-weight model diverge: the first
    # differing position is reported), and batch 1's tok/s on vs off is a measured speedup.
    gen0 = torch.Generator().manual_seed(1)
    vocab0 = engine.config.model.arch.vocab_size
    motifs = [torch.randint(3, vocab0, (24,), generator=gen0).tolist() for _ in range(4)]
    rep_prompts = [motif * 5 for motif in motifs]
    rep_out = 32 if smoke else 128
    max_len0 = engine.config.model.max_model_len
    ngram_on = NgramProposer(SpecConfig.build("ngram", None, 4, 4, 2, None), max_len0)
    exact: dict[str, Any] = {"prompts": len(rep_prompts), "prompt_len": len(rep_prompts[0]), "output_len": rep_out}
    for label, batch_prompts in (("batch_1", rep_prompts[:1]), ("batch_4", rep_prompts)):
        throughput(llm, None, batch_prompts, 4)  # warm-up
        runs0: dict[str, Any] = {}
        ids: dict[str, list[list[int]]] = {}
        for mode, proposer in (("off", None), ("ngram", ngram_on), ("off_again", None), ("ngram_again", ngram_on)):
            engine.proposer = proposer
            params = SamplingParams(temperature=0.0, max_tokens=rep_out, ignore_eos=True)
            before = (engine.stats.spec_decode_num_draft_tokens, engine.stats.spec_decode_num_accepted_tokens)
            start = time.perf_counter()
            outs = llm.generate(batch_prompts, params)
            elapsed = time.perf_counter() - start
            ids[mode] = [list(o.outputs[0].token_ids) for o in outs]
            runs0[mode] = {"output_tok_s": round(sum(map(len, ids[mode])) / elapsed, 1),
                           "draft_tokens": engine.stats.spec_decode_num_draft_tokens - before[0],
                           "accepted_tokens": engine.stats.spec_decode_num_accepted_tokens - before[1]}
        diverge = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                   for x, y in zip(ids["off"], ids["ngram"], strict=True)]
        best_on = max(runs0["ngram"]["output_tok_s"], runs0["ngram_again"]["output_tok_s"])
        best_off = max(runs0["off"]["output_tok_s"], runs0["off_again"]["output_tok_s"])
        exact[label] = {"runs": runs0, "greedy_identical": ids["off"] == ids["ngram"],
                        "first_divergence": diverge, "speedup": round(best_on / best_off, 3)}
        print(f"exactness {label}: {exact[label]}", flush=True)
    engine.proposer = None
    record["engine_path_repetitive_prompts"] = exact

    # 1. verify vs decode
    verify: dict[str, Any] = {}
    for batch in batches:
        decode_ms = time_steps(engine, batch, 0, iters, "decode")
        row: dict[str, Any] = {"decode_ms": round(decode_ms, 3)}
        for k in ks:
            ms = time_steps(engine, batch, k, iters, "verify")
            row[f"verify_k{k}_ms"] = round(ms, 3)
            row[f"verify_k{k}_ratio"] = round(ms / decode_ms, 3)
        verify[f"batch_{batch}"] = row
        print(f"batch {batch}: {row}", flush=True)
    record["verify_vs_decode"] = verify

    # 2. projection from the CPU acceptance
    cpu = ROOT / "bench" / "results" / "spec_cpu_smollm2.json"
    k4 = verify[f"batch_{batches[0]}"].get("verify_k4_ratio")
    if cpu.is_file() and k4:
        sets = json.loads(cpu.read_text())["sets"]
        projection = {}
        for set_name, result in sets.items():
            length = (result.get("ngram_acceptance") or {}).get("acceptance_length")
            if length:
                projection[set_name] = {"cpu_acceptance_length": length, "verify_k4_ratio_batch1": k4,
                                        "projected_speedup": round(length / k4, 3)}
        record["projected_batch1_speedup_ngram_k4"] = projection
        print(f"projection: {projection}", flush=True)

    # 3. concurrency 64: off vs n-gram (disable_by_batch_size=8) vs n-gram always
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.model.arch.vocab_size
    prompts = [torch.randint(3, vocab, (in_len,), generator=gen).tolist() for _ in range(n_prompts)]
    max_len = engine.config.model.max_model_len
    modes = {
        "off": None,
        "ngram_disable_by_batch_size_8": NgramProposer(SpecConfig.build("ngram", None, 4, 4, 2, 8), max_len),
        "ngram_always": NgramProposer(SpecConfig.build("ngram", None, 4, 4, 2, None), max_len),
    }
    throughput(llm, None, prompts[:4], 8)  # warm-up
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(2):
        for mode, proposer in modes.items():
            result = throughput(llm, proposer, prompts, out_len)
            runs[mode].append(result)
            print(f"concurrency {n_prompts} {mode}: {result}", flush=True)
    best = {m: max(r["output_tok_s"] for r in rs) for m, rs in runs.items()}
    record["concurrency"] = {
        "num_prompts": n_prompts, "input_len": in_len, "output_len": out_len, "runs": runs,
        "best_output_tok_s": best,
        "slowdown_disable_by_batch_size_8": round(1 - best["ngram_disable_by_batch_size_8"] / best["off"], 4),
        "slowdown_always": round(1 - best["ngram_always"] / best["off"], 4),
    }
    print(json.dumps(record["concurrency"]["best_output_tok_s"]), flush=True)
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"spec_gpu_{slug}{'_smoke' if smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")

    # 4. the draft-model proposer on this device (its own paged KV and CUDA graphs): a 2-layer truncation of the
    # same preset drafts for it at batch 1. Dummy weights: the acceptance means nothing; this checks the path runs
    # and times it.
    del llm, engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    draft = {"model": model, "num_speculative_tokens": 4, "draft_num_layers": 2}
    try:
        spec_llm = LLM(model, speculative_config=draft, **engine_args)
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        spec_llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        start = time.perf_counter()
        result = spec_llm.generate(prompts[:1], params)[0]
        elapsed = time.perf_counter() - start
        s = spec_llm.stats
        record["draft_model_batch1"] = {
            "config": draft, "output_tok_s": round(len(result.outputs[0].token_ids) / elapsed, 1),
            "acceptance_length": s.spec_decode_mean_acceptance_length, "drafts": s.spec_decode_num_drafts}
    except Exception as exc:  # recorded, so the earlier parts' record stands
        record["draft_model_batch1"] = {"config": draft, "error": repr(exc)}
    print(f"draft model: {record['draft_model_batch1']}", flush=True)
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
