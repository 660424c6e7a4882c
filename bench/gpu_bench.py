"""Check and time the engine on a CUDA GPU, beside HF transformers, in one call.

Order: device, versions and the two measured ceilings (D2D copy GB/s counting read + write; bf16 8192^3 matmul
TFLOP/s); correctness (PASS/FAIL lines: kvflow vs transformers greedy ids on random tiny configs in fp32, first
divergence within the other side's top-5 in bf16, the same outputs with --enforce-eager on and off at several
batch sizes; the fused kernels, bench/gpu_checks.py); then the workloads, each run by kvflow and (where listed) by
transformers `generate` on the same random-weight config (`from_config`, bf16, sdpa):

  llama8b_b1_decode   Llama-3.1-8B shapes, batch 1, 128 in / 256 out         roofline fraction of decode
  llama8b_1000        Llama-3.1-8B shapes, 1000 prompts, 512 in / 128 out    MFU; HF timed at batch 64
                      (the engine's default batch limits; then 256 seqs / 8k and 512 / 16k tokens)
  qwen05b_b1_decode   Qwen2.5-0.5B shapes, batch 1, 128 in / 256 out         roofline fraction of decode
  llama8b_prefill_8k  one 8192-token prefill step                             MFU

Roofline fraction (decode): bytes one step must read (every weight the step multiplies with, plus the KV of
the context) / measured copy bandwidth = ideal step time; fraction = ideal / measured step time.
MFU = total tokens x 2 x params / time / measured bf16 matmul rate (the issue's formula; `mfu_counted` uses
the FLOPs actually needed: linear layers, lm_head on sampled rows only, causal attention).

Results: $OUT/gpu_bench.json (rewritten after every record, so a timeout keeps what finished) and, with
--record, bench/results/gpu_<device>.json. `--quick` runs every workload at reduced size (a smoke test).
(KVFLOW_PROFILE_HOST / KVFLOW_PROFILE_KERNELS, the cProfile and per-kernel hooks bench/GPU_NOTES.md quotes, were
retired: they run at `git checkout be1a1ae`.)

    PYTHONUNBUFFERED=1 python -m bench.gpu_bench --quick
    PYTHONUNBUFFERED=1 python -m bench.gpu_bench --record
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from bench import gpu_checks
from bench.gpu_checks import (
    DEV,
    Report,
    build_engine,
    build_hf,
    hf_generate,
    load_hf_weights,
    random_prompts,
    release_memory,
    run_requests,
)
from bench.harness.ceilings import copy_bytes_per_s, matmul_flops_per_s
from bench.harness.records import RESULTS, device_slug
from bench.harness.runs import first_divergence, step_until_done
from bench.harness.timing import cuda_event_seconds
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


# ---- workloads -------------------------------------------------------------------------------------------------
def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads: all but the input embedding (only a few rows are gathered)."""
    arch = engine.config.model.arch
    embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return (arch.num_params - embedding) * engine.runner.dtype.itemsize


def counted_flops(engine: LLMEngine, prompt_len: int, out_len: int, num_seqs: int) -> float:
    """Linear layers on every token, lm_head on sampled rows, causal attention (QK and PV)."""
    arch = engine.config.model.arch
    lm_head = arch.vocab_size * arch.hidden_size
    linear = arch.num_params - lm_head - (0 if arch.tie_word_embeddings else lm_head)
    total_tokens = prompt_len + out_len
    per_seq = 2 * linear * total_tokens + 2 * lm_head * out_len
    per_seq += 4 * arch.num_layers * arch.num_heads * arch.head_dim * (total_tokens**2 / 2)
    return per_seq * num_seqs


def decode_graph_figures(engine: LLMEngine, tpot_s: float) -> dict[str, Any]:
    """GPU time of one batch-1 decode forward (forward + lm_head + argmax) from its graph: step time minus this is
    host time (< 0 ms: decode-ahead hides the host)."""
    graphs = engine.runner.graphs
    graph = graphs.graphs[graphs.sizes[0]].graph
    replay_ms = cuda_event_seconds(graph.replay, 50) * 1e3
    return {"graph_replay_ms": replay_ms, "host_ms_per_step": tpot_s * 1e3 - replay_ms,
            "decode_ahead_hits": engine.runner.decode_ahead.hits,
            "decode_ahead_misses": engine.runner.decode_ahead.misses}


@dataclass(frozen=True)
class DecodeShape:
    prompt_len: int
    out_len: int
    repeats: int


def decode_workload(report: Report, name: str, engine: LLMEngine, hf: Any | None, shape: DecodeShape,
                    hf_out_len: int) -> None:
    arch = engine.config.model.arch
    params = SamplingParams(temperature=0.0, max_tokens=shape.out_len, ignore_eos=True)
    run_requests(engine, random_prompts(1, shape.prompt_len, arch.vocab_size, seed=99), params)  # warm-up
    runs = [run_requests(engine, random_prompts(1, shape.prompt_len, arch.vocab_size, seed=100 + r), params)
            for r in range(shape.repeats)]
    best = min(runs, key=lambda r: r["elapsed"])
    out_tok_s, decode_tok_s = shape.out_len / best["elapsed"], 1.0 / best["tpot"]
    step_bytes = weight_bytes_per_step(engine) + (shape.prompt_len + shape.out_len / 2) * \
        arch.kv_bytes_per_token(engine.runner.dtype.itemsize)
    ideal_tok_s = report.meta["copy_gbps"] * 1e9 / step_bytes
    rec = {"workload": name, "model_shapes": engine.config.model.model, "batch": 1, "prompt_len": shape.prompt_len,
           "out_len": shape.out_len, "kvflow_out_tok_s": out_tok_s, "kvflow_decode_tok_s": decode_tok_s,
           "kvflow_ttft_ms": best["ttft"] * 1e3, "kvflow_tpot_ms": best["tpot"] * 1e3,
           "kvflow_runs_s": [r["elapsed"] for r in runs], "step_bytes": step_bytes,
           "ideal_decode_tok_s": ideal_tok_s, "roofline_fraction": decode_tok_s / ideal_tok_s,
           "cuda_graphs": engine.runner.graphs is not None}
    if engine.runner.graphs is not None:
        rec.update(decode_graph_figures(engine, best["tpot"]))
    if hf is not None:
        prompt = random_prompts(1, shape.prompt_len, arch.vocab_size, seed=100)
        hf_generate(hf, prompt, 8)  # warm-up
        hf_s = hf_generate(hf, prompt, hf_out_len)[2]
        rec.update(hf_out_tok_s=hf_out_len / hf_s, hf_out_len=hf_out_len, ratio=out_tok_s / (hf_out_len / hf_s))
    report.record(rec)


def hf_throughput(hf: Any, num_prompts: int, prompt_len: int, out_len: int, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(num_prompts, prompt_len, vocab, seed=7)
    hf_generate(hf, prompts[:2], 4)  # warm-up
    seconds = hf_generate(hf, prompts, out_len)[2]
    return {"hf_out_tok_s": num_prompts * out_len / seconds, "hf_batch": num_prompts, "hf_seconds": seconds}


def throughput_workload(report: Report, name: str, engine: LLMEngine, num_prompts: int, prompt_len: int,
                        out_len: int, hf_rec: dict[str, Any] | None) -> None:
    arch = engine.config.model.arch
    # Warm-up at the run's batch shapes (full prefill steps, mixed steps, decode beyond the captured sizes): the
    # Triton kernels specialize per shape class and compile on first use, which cost the first engine of a
    # process ~6 s of a 27 s run before (bench/GPU_NOTES.md).
    warm = min(num_prompts, engine.config.scheduler.max_num_seqs + 64)
    run_requests(engine, random_prompts(warm, prompt_len, arch.vocab_size, seed=1),
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    res = run_requests(engine, random_prompts(num_prompts, prompt_len, arch.vocab_size, seed=2),
                       SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    seconds = res["elapsed"]
    peak = report.meta["matmul_tflops"] * 1e12
    total_tokens = num_prompts * (prompt_len + out_len)
    rec = {"workload": name, "model_shapes": engine.config.model.model, "num_prompts": num_prompts,
           "prompt_len": prompt_len, "out_len": out_len, "max_num_seqs": engine.config.scheduler.max_num_seqs,
           "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
           "kvflow_out_tok_s": res["out_tokens"] / seconds, "kvflow_total_tok_s": total_tokens / seconds,
           "kvflow_seconds": seconds, "steps": res["steps"],
           "mfu": total_tokens * 2 * arch.num_params / seconds / peak,
           "mfu_counted": counted_flops(engine, prompt_len, out_len, num_prompts) / seconds / peak,
           "kvflow_ttft_median_s": res["ttft"], "kvflow_tpot_median_ms": (res["tpot"] or 0) * 1e3}
    if hf_rec:
        rec.update(hf_rec, ratio=rec["kvflow_out_tok_s"] / hf_rec["hf_out_tok_s"])
    report.record(rec)


def prefill_workload(report: Report, name: str, engine: LLMEngine, tokens: int, repeats: int) -> None:
    arch = engine.config.model.arch
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(repeats + 1):  # the first is a warm-up
        engine.add_request(None, random_prompts(1, tokens, arch.vocab_size, seed=500 + r)[0], params,
                           output_kind="final")
        torch.cuda.synchronize()
        started = time.perf_counter()
        steps = step_until_done(engine)[1]
        if r:
            times.append(time.perf_counter() - started)
    seconds = min(times)
    peak = report.meta["matmul_tflops"] * 1e12
    report.record({"workload": name, "model_shapes": engine.config.model.model, "prompt_tokens": tokens,
                   "steps": steps, "kvflow_prefill_s": seconds, "kvflow_prefill_tok_s": tokens / seconds,
                   "kvflow_runs_s": times, "mfu": tokens * 2 * arch.num_params / seconds / peak,
                   "mfu_counted": counted_flops(engine, tokens, 0, 1) / seconds / peak})


# ---- parts -----------------------------------------------------------------------------------------------------
class Parts:
    """The run's parts, in order; each records into the report and frees the GPU after itself."""

    ORDER = ("correctness", "qwen", "llama8b")

    def __init__(self, report: Report, quick: bool) -> None:
        self.report, self.quick = report, quick

    def correctness(self) -> None:
        gpu_checks.check_fused_kernels(self.report)
        prompts = [p[: 6 + 9 * i] for i, p in enumerate(random_prompts(4, 64, 500, seed=11))]
        for preset in ("tiny-llama", "tiny-qwen2", "tiny-qwen3"):
            gpu_checks.check_vs_hf(self.report, preset, "float32", prompts, 24)
            gpu_checks.check_vs_hf(self.report, preset, "bfloat16", prompts, 24)
        gpu_checks.check_eager_vs_graphs(self.report, "tiny-llama", "float32")
        gpu_checks.check_eager_vs_graphs(self.report, "tiny-qwen3", "float32")
        gpu_checks.check_eager_vs_graphs(self.report, "tiny-llama", "bfloat16", across_batches=False)
        gpu_checks.check_eager_vs_graphs(self.report, "tiny-qwen2", "bfloat16", across_batches=False)

    def qwen(self) -> None:
        hf = build_hf("qwen2.5-0.5b", torch.bfloat16)
        engine = build_engine("qwen2.5-0.5b", max_model_len=2048, max_num_seqs=8)
        load_hf_weights(engine, hf)
        prompts = random_prompts(2, 40, 151000, seed=5)
        mine = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                            logprobs=5))
        for i, prompt in enumerate(prompts):
            theirs, logits, _ = hf_generate(hf, [prompt], 32, want_logits=True)
            assert logits is not None
            ours = mine["token_ids"][i]
            j = first_divergence(ours, theirs[0])
            name = f"hf_top5_divergence_qwen2.5-0.5b_bf16_{i}"
            if j is None:
                self.report.check(name, True, "32/32 tokens identical")
            else:
                top5 = logits[j][0].topk(5).indices.tolist()
                self.report.check(name, ours[j] in top5,
                                  f"first divergence at {j}: kvflow {ours[j]}, HF {theirs[0][j]} (HF top5 {top5})")
        decode_workload(self.report, "qwen05b_b1_decode", engine, hf,
                        DecodeShape(128, 64 if self.quick else 256, 2 if self.quick else 3), 64 if self.quick else 256)
        del engine, hf

    def llama8b(self) -> None:
        quick = self.quick
        num_prompts = 100 if quick else 1000
        hf = build_hf("llama-3.1-8b", torch.bfloat16)
        hf_b1 = random_prompts(1, 128, 128000, seed=100)
        hf_generate(hf, hf_b1, 8)
        hf_out = 32 if quick else 128
        hf_b1_tok_s = hf_out / hf_generate(hf, hf_b1, hf_out)[2]
        print(f"HF llama8b batch 1: {hf_b1_tok_s:.1f} tok/s", flush=True)
        hf_batch = hf_throughput(hf, 16 if quick else 64, 512, 32 if quick else 128, 128000)
        print(f"HF llama8b batch {hf_batch['hf_batch']}: {hf_batch['hf_out_tok_s']:.0f} out tok/s", flush=True)
        del hf
        release_memory()
        # The engine's own batch limits (vLLM's defaults: 1024 seqs / 16,384 batched tokens on >= 70 GiB GPUs).
        engine = build_engine("llama-3.1-8b", max_model_len=8192 + 64, enable_prefix_caching=False,
                              **(dict(max_num_seqs=64) if quick else {}))
        decode_workload(self.report, "llama8b_b1_decode", engine, None, DecodeShape(128, 64 if quick else 256, 2), 0)
        rec = self.report.records[-1]
        rec.update(hf_out_tok_s=hf_b1_tok_s, hf_out_len=hf_out, ratio=rec["kvflow_out_tok_s"] / hf_b1_tok_s)
        self.report.save()
        print(f"llama8b_b1_decode vs HF: ratio {rec['ratio']:.2f}", flush=True)
        throughput_workload(self.report, "llama8b_1000", engine, num_prompts, 512, 128, hf_batch)
        prefill_workload(self.report, "llama8b_prefill_8k", engine, 8192, 2 if quick else 3)
        del engine
        release_memory()
        # Smaller batch limits for comparison (vLLM's on smaller GPUs, and a middle point).
        for seqs, tokens in ((256, 8192), (512, 16384)):
            engine = build_engine("llama-3.1-8b", max_model_len=8192 + 64, max_num_seqs=64 if quick else seqs,
                                  max_num_batched_tokens=tokens, enable_prefix_caching=False)
            throughput_workload(self.report, f"llama8b_1000_seqs{seqs}_tokens{tokens // 1024}k", engine,
                                num_prompts, 512, 128, hf_batch)
            del engine
            release_memory()

    def run(self, name: str) -> None:
        started = time.perf_counter()
        try:
            getattr(self, name)()
        except Exception as exc:  # one broken part must not hide the others' results
            traceback.print_exc()
            self.report.check(f"ran_{name}", False, f"{type(exc).__name__}: {exc}")
        release_memory()  # after the except block, which kept the failed frame (and its models) alive
        print(f"-- {name}: {time.perf_counter() - started:.1f}s", flush=True)


def measure_meta(report: Report, quick: bool) -> None:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(DEV)
    report.meta.update(device=torch.cuda.get_device_name(DEV), sm_count=props.multi_processor_count,
                       mem_gib=props.total_memory / 2**30, torch=torch.__version__, triton=triton.__version__,
                       transformers=transformers.__version__, cuda=torch.version.cuda, quick=quick)
    events = lambda fn: cuda_event_seconds(fn, 20)  # noqa: E731
    copy_bps = copy_bytes_per_s(torch.randn(1 << 28, device=DEV), events)  # 1 GiB fp32
    mm_flops = matmul_flops_per_s(8192, events)
    torch.cuda.empty_cache()
    report.meta.update(copy_gbps=copy_bps / 1e9, matmul_tflops=mm_flops / 1e12)
    print("META " + json.dumps(report.meta), flush=True)


def print_summary(report: Report) -> None:
    print("\n== summary ==")
    for c in report.checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'} {c['check']}")
    keys = ("kvflow_out_tok_s", "kvflow_decode_tok_s", "hf_out_tok_s", "ratio", "roofline_fraction", "mfu",
            "mfu_counted", "kvflow_prefill_s")
    for r in report.records:
        print(r["workload"], " ".join(f"{k}={r[k]:.3g}" for k in keys if isinstance(r.get(k), float)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every workload at reduced size (smoke test)")
    parser.add_argument("--record", action="store_true", help="write bench/results/gpu_<device>.json")
    parser.add_argument("--only", nargs="*", default=None, choices=Parts.ORDER, help="a subset (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = Report(os.environ.get("OUT"))
    measure_meta(report, args.quick)
    parts = Parts(report, args.quick)
    wanted = set(args.only or Parts.ORDER)
    for name in Parts.ORDER:
        if name in wanted:
            parts.run(name)
    if args.record:
        path = RESULTS / f"gpu_{device_slug(report.meta['device'])}.json"
        path.write_text(report.text())
        print(f"wrote {path}")
    print_summary(report)


if __name__ == "__main__":
    main()
