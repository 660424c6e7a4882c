#!/usr/bin/env python3
"""Check and time the engine on a CUDA GPU, beside HF transformers, in one call.

Order: device, versions and the two measured ceilings (D2D copy GB/s counting read + write; bf16 8192^3 matmul
TFLOP/s); correctness (PASS/FAIL lines: kvflow vs transformers greedy ids on random tiny configs in fp32, first
divergence within the other side's top-5 in bf16, the same outputs with --enforce-eager on and off at several
batch sizes); then the workloads, each run by kvflow and (where listed) by transformers `generate` on the same
random-weight config (`from_config`, bf16, sdpa):

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

    PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --quick
    PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --record
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.arg_utils import EngineArgs  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.models.presets import preset_hf_config  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

DEV = torch.device("cuda")
PROFILE_HOST = os.environ.get("KVFLOW_PROFILE_HOST") == "1"  # cProfile one batch-1 decode run per workload
PROFILE_KERNELS = os.environ.get("KVFLOW_PROFILE_KERNELS") == "1"  # per-kernel GPU time of a decode graph
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Report:
    """Collects records and PASS/FAIL checks; rewrites the JSON after every addition."""

    def __init__(self, out_dir: str | None) -> None:
        self.meta: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self.path = Path(out_dir) / "gpu_bench.json" if out_dir else None

    def check(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        self.checks.append({"check": name, "ok": ok, "detail": detail})
        self.save()

    def record(self, rec: dict[str, Any]) -> None:
        rec = {"device": self.meta.get("device"), **rec}
        print("RECORD " + json.dumps(rec), flush=True)
        self.records.append(rec)
        self.save()

    def text(self) -> str:
        return json.dumps({"meta": self.meta, "checks": self.checks, "records": self.records}, indent=1)

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(self.text())


# ---- ceilings ------------------------------------------------------------------------------------------------
def cuda_time(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of fn over reps, timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bytes_per_s() -> float:
    src = torch.randn(1 << 28, device=DEV)  # 1 GiB fp32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / cuda_time(lambda: dst.copy_(src), 20)


def matmul_flops_per_s() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    return 2 * 8192**3 / cuda_time(lambda: a @ b, 20)


# ---- engines -------------------------------------------------------------------------------------------------
def build_engine(model: str, **kwargs: Any) -> LLMEngine:
    args = dict(load_format="dummy", device="cuda", seed=0)
    args.update(kwargs)
    return LLMEngine(EngineArgs(model=model, **args).create_engine_config())


def release_memory() -> None:
    """After the caller dropped its references: collect (graphs, caches) and return cached blocks to CUDA."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_requests(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Submit every prompt, step to completion; wall time, TTFT/TPOT and outputs (in submission order)."""
    ids = [engine.add_request(None, p, params, output_kind="final") for p in prompts]
    engine.take_finished_timings()
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
    elapsed = time.perf_counter() - started
    timings = engine.take_finished_timings()
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    tpots = [t.mean_tpot_s for t in timings if t.mean_tpot_s is not None]
    return {
        "elapsed": elapsed, "steps": steps,
        "token_ids": [list(outputs[i].outputs[0].token_ids) for i in ids],
        "logprobs": [outputs[i].outputs[0].logprobs for i in ids],
        "ttft": statistics.median(ttfts) if ttfts else None,
        "tpot": statistics.median(tpots) if tpots else None,
        "out_tokens": sum(len(outputs[i].outputs[0].token_ids) for i in ids),
    }


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (count, length), generator=g).tolist()


# ---- transformers ----------------------------------------------------------------------------------------------
def build_hf(preset: str, dtype: torch.dtype, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = preset_hf_config(preset)
    with torch.device(DEV):  # random init directly on the GPU
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    model.eval()
    # No EOS: both sides generate exactly max_new_tokens (kvflow runs with ignore_eos).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, want_logits: bool = False
                ) -> tuple[list[list[int]], list[torch.Tensor] | None, float]:
    """Greedy generate of equal-length prompts as one batch; (new ids per prompt, per-step logits, seconds)."""
    input_ids = torch.tensor(prompts, device=DEV)
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, output_logits=want_logits)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    ids = out.sequences[:, input_ids.shape[1]:].tolist()
    logits = [step.float() for step in out.logits] if want_logits else None
    return ids, logits, elapsed


def load_hf_weights(engine: LLMEngine, hf_model: Any) -> None:
    """Same weights on both sides: the kvflow model takes transformers' (copied in place, graph-safe)."""
    engine.runner.model.load_hf_state_dict(hf_model.state_dict())


# ---- correctness -----------------------------------------------------------------------------------------------
def check_vs_hf(report: Report, preset: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> None:
    hf = build_hf(preset, HF_DTYPES[dtype])
    engine = build_engine(preset, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_model_len=512,
                          max_num_seqs=16)
    load_hf_weights(engine, hf)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    mine = run_requests(engine, prompts, params)
    exact, within, worst = 0, 0, ""
    for i, prompt in enumerate(prompts):
        theirs, logits, _ = hf_generate(hf, [prompt], new_tokens, want_logits=True)
        assert logits is not None
        ours, hf_ids = mine["token_ids"][i], theirs[0]
        if ours == hf_ids:
            exact += 1
            within += 1
            continue
        j = next(k for k in range(new_tokens) if ours[k] != hf_ids[k])
        hf_top5 = logits[j][0].topk(5).indices.tolist()
        our_top5 = [tok for tok, lp in mine["logprobs"][i][j].items() if lp.rank <= 5]
        ok = ours[j] in hf_top5 and hf_ids[j] in our_top5
        within += ok
        worst = f"prompt {i} diverges at {j}: kvflow {ours[j]} (HF top5 {hf_top5}), HF {hf_ids[j]}"
    n = len(prompts)
    if dtype == "float32":
        report.check(f"hf_greedy_exact_{preset}_fp32", exact == n, f"{exact}/{n} identical; {worst}")
    else:
        report.check(f"hf_top5_divergence_{preset}_{dtype}", within == n,
                     f"{exact}/{n} identical, {within}/{n} identical or first divergence in the other's top-5; "
                     f"{worst}")
    del hf, engine
    release_memory()


def check_eager_vs_graphs(report: Report, preset: str, dtype: str, across_batches: bool = True) -> None:
    """Greedy ids with --enforce-eager on and off, prompts run in groups of 1, 3 and 8. fp32: every run equals
    eager batch 8. bf16 (`across_batches=False`): eager == graphs at each group size (batches of <= 16 tokens take
    the small-batch GEMMs, larger prefills cuBLAS, so bf16 ids may legitimately differ between group sizes)."""
    prompts = [p[: 5 + 7 * i] for i, p in enumerate(random_prompts(8, 64, 500, seed=3))]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = {}
    for eager in (True, False):
        engine = build_engine(preset, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_model_len=512,
                              max_num_seqs=16, enforce_eager=eager)
        for group in (1, 3, 8):
            outs: list[list[int]] = []
            for start in range(0, len(prompts), group):
                outs += run_requests(engine, prompts[start : start + group], params)["token_ids"]
            results[(eager, group)] = outs
        del engine
        release_memory()
    if not across_batches:
        same_group = [g for g in (1, 3, 8) if results[(True, g)] == results[(False, g)]]
        report.check(f"eager_vs_graphs_{preset}_{dtype}", len(same_group) == 3,
                     f"eager == graphs at group sizes {same_group} of (1, 3, 8)")
        return
    ref = results[(True, 8)]
    same = [k for k, v in results.items() if v == ref]
    report.check(f"eager_vs_graphs_batch_sizes_{preset}_{dtype}", len(same) == len(results),
                 f"{len(same)}/{len(results)} (eager, group size) runs identical to eager batch 8; "
                 f"differing: {[k for k in results if k not in same]}")


def graph_time_per_call(fn: Callable[[], Any], calls: int = 32, reps: int = 30) -> float:
    """Seconds per call of fn, from a CUDA graph of `calls` back-to-back calls (how the decode graphs run it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, reps) / calls


def rotary_then_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos_sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """The two kernels the fused rotary_and_write_kv replaces."""
    from kernels.kv_cache_write import write_kv_cache
    from kernels.rotary import rotary_embedding

    rotary_embedding(positions, q, k, cos_sin)
    write_kv_cache(k, v, key_cache, value_cache, slots)


def check_fused_kernels(report: Report) -> None:
    """The fused decode kernels on the GPU: single-pass split-KV decode against the two-kernel combine and the
    fp64 reference (repeated with one ticket buffer: a race would move the result), fused rotary + KV write
    bit-identical to the two kernels; then each pair timed inside a CUDA graph (Llama-8B and Qwen-0.5B shapes)."""
    import kernels.paged_decode_attention as dec
    from kernels.rotary import build_cos_sin_cache
    from kernels.rotary_kv_write import rotary_and_write_kv

    g = torch.Generator(device=DEV).manual_seed(0)
    timings: dict[str, float] = {}
    for label, heads, kv_heads, dim in (("llama8b", 32, 8, 128), ("qwen05b", 14, 2, 64)):
        worst, stable = 0.0, True
        for batch in (1, 4, 32):
            lens = torch.randint(1, 2000, (batch,), generator=g, device=DEV).int()
            lens[0] = 300
            blocks_per = 2000 // 16 + 1
            kc = torch.randn(batch * blocks_per + 1, 16, kv_heads, dim, generator=g, device=DEV).bfloat16()
            vc = torch.randn_like(kc)
            tables = (1 + torch.randperm(batch * blocks_per, generator=g, device=DEV)).int().view(batch, -1)
            q = torch.randn(batch, heads, dim, generator=g, device=DEV).bfloat16()
            tickets = torch.zeros(batch * kv_heads, dtype=torch.int32, device=DEV)
            runs = [dec.paged_decode_attention(q, kc, vc, tables, lens, dim**-0.5, max_seq_len=8192,
                                               tickets=tickets, single_pass=True) for _ in range(20)]
            two = dec.paged_decode_attention(q, kc, vc, tables, lens, dim**-0.5, max_seq_len=8192,
                                             single_pass=False)
            ref = dec.paged_decode_attention_ref(q.double(), kc.double(), vc.double(), tables, lens, dim**-0.5)
            stable &= all(torch.equal(r, runs[0]) for r in runs) and int(tickets.abs().sum()) == 0
            worst = max(worst, float((runs[0].double() - ref).norm() / ref.norm()),
                        float((runs[0].double() - two.double()).norm() / two.double().norm()))
            if batch == 1:
                for single in (True, False):
                    call = functools.partial(dec.paged_decode_attention, q, kc, vc, tables, lens, dim**-0.5,
                                             max_seq_len=8192, tickets=tickets, single_pass=single)
                    name = f"{label}_decode_b1_ctx300_{'single_pass' if single else 'two_kernel'}_us"
                    timings[name] = 1e6 * graph_time_per_call(call)
        report.check(f"single_pass_decode_{label}", stable and worst < 1e-2,
                     f"20 launches identical, tickets back to 0: {stable}; worst rel err vs fp64 ref / two-kernel "
                     f"{worst:.2e}")
        cos_sin = build_cos_sin_cache(8192, dim, device=DEV)
        qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, generator=g, device=DEV).bfloat16()
        pos = torch.tensor([777], device=DEV)
        slots = torch.tensor([5 * 16 + 3], device=DEV)
        outs, calls = [], []
        for fn in (rotary_and_write_kv, rotary_then_write_kv):
            x, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
            qv, kv, vv = x.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            args = (pos, qv.view(1, heads, dim), kv.view(1, kv_heads, dim), vv.view(1, kv_heads, dim), cos_sin,
                    kc2, vc2, slots)
            fn(*args)
            outs.append((x.clone(), kc2[5].clone(), vc2[5].clone()))
            calls.append(functools.partial(fn, *args))
        timings[f"{label}_rotary_kv_fused_us"] = 1e6 * graph_time_per_call(calls[0])
        timings[f"{label}_rotary_kv_separate_us"] = 1e6 * graph_time_per_call(calls[1])
        same = all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
        report.check(f"fused_rotary_kv_write_{label}", same, f"bit-identical to rotary + write_kv_cache: {same}")
    report.record({"workload": "fused_kernel_timings", **timings})


SMALL_GEMM_SHAPES = {  # (hidden, q + 2 kv, intermediate, vocab)
    "llama8b": (4096, 6144, 14336, 128256),
    "qwen05b": (896, 1152, 4864, 151936),
}
SMALL_GEMM_CONFIGS = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 4),
                      (64, 256, 8, 3), (128, 128, 4, 4), (32, 512, 4, 3)]


def unfused_chain(x: torch.Tensor, weight: torch.Tensor, prologue: str = "none", residual: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  argmax: bool = False, small: bool = False, impl: str = "dot") -> Any:
    """What the engine ran before kernels/small_gemm.py: norm / SwiGLU kernel, cuBLAS, cast, torch argmax;
    `small`: the same with the matmul (and argmax) through small_gemm without prologue."""
    import torch.nn.functional as F

    from kernels.rms_norm import fused_add_rms_norm
    from kernels.silu_and_mul import silu_and_mul
    from kernels.small_gemm import small_gemm

    if prologue == "norm":
        assert residual is not None and norm_weight is not None
        x = fused_add_rms_norm(x, residual, norm_weight, 1e-5)[0]  # in place: values drift, timing does not
    elif prologue == "silu":
        x = silu_and_mul(x)
    if small:
        return small_gemm(x, weight, out=out, argmax=argmax, impl=impl)
    y = F.linear(x, weight)
    if out is not None:
        y = out.copy_(y)
    return y.argmax(dim=-1) if argmax else y


def check_small_gemm(report: Report) -> None:
    """kernels/small_gemm.py on the GPU at Llama-8B / Qwen-0.5B layer shapes, M = 1 and 4: each prologue vs the
    fp32 torch reference, the residual sum bit-equal, the fused argmax equal to torch's; then, per shape at M = 1,
    the fused kernel vs the unfused chain it replaces (norm kernel + cuBLAS, SwiGLU kernel + cuBLAS, cuBLAS +
    cast + argmax) inside a CUDA graph, and a sweep of the tl.dot kernel's block configs (the GEMV's streaming
    variants are timed in context by bench/gpu_gemv.py)."""
    from kernels.small_gemm import small_gemm, small_gemm_ref

    g = torch.Generator(device=DEV).manual_seed(0)
    timings: dict[str, Any] = {}
    for label, (hidden, qkv, inter, vocab) in SMALL_GEMM_SHAPES.items():
        bf = torch.bfloat16
        w_qkv = (torch.randn(qkv, hidden, generator=g, device=DEV) / hidden**0.5).to(bf)
        w_o = (torch.randn(hidden, hidden, generator=g, device=DEV) / hidden**0.5).to(bf)
        w_gu = (torch.randn(2 * inter, hidden, generator=g, device=DEV) / hidden**0.5).to(bf)
        w_down = (torch.randn(hidden, inter, generator=g, device=DEV) / inter**0.5).to(bf)
        w_head = (torch.randn(vocab, hidden, generator=g, device=DEV) / hidden**0.5).to(bf)
        norm_w = (1 + 0.1 * torch.randn(hidden, generator=g, device=DEV)).to(bf)
        worst, exact = 0.0, True
        for m in (1, 4):
            x = torch.randn(m, hidden, generator=g, device=DEV).to(bf)
            res = torch.randn(m, hidden, generator=g, device=DEV).to(bf)
            gu = torch.randn(m, 2 * inter, generator=g, device=DEV).to(bf)
            cases = [(x, w_qkv, dict(prologue="norm", residual=res, norm_weight=norm_w)), (x, w_o, {}),
                     (gu, w_down, dict(prologue="silu"))]
            for xin, w, kw in cases:
                y, rsum, _ = small_gemm(xin, w, **kw)
                ref, ref_sum = small_gemm_ref(xin, w, **kw)
                worst = max(worst, float((y.double() - ref.double()).norm() / ref.double().norm()))
                if ref_sum is not None:
                    exact &= rsum is not None and torch.equal(rsum, ref_sum)
            logits = torch.empty(m, vocab, device=DEV)
            logits, _, tokens = small_gemm(x, w_head, out=logits, argmax=True)
            exact &= tokens is not None and torch.equal(tokens, logits.argmax(dim=-1))
        report.check(f"small_gemm_{label}", worst < 1e-2 and exact,
                     f"worst rel err vs fp32 ref {worst:.2e}; residual sum and argmax exact: {exact}")
        for m in (1, 4):
            x = torch.randn(m, hidden, generator=g, device=DEV).to(bf)
            res = torch.randn(m, hidden, generator=g, device=DEV).to(bf)
            gu = torch.randn(m, 2 * inter, generator=g, device=DEV).to(bf)
            logits = torch.empty(m, vocab, device=DEV)
            norm_kw = dict(prologue="norm", residual=res, norm_weight=norm_w)
            cases = {"qkv_norm": (x, w_qkv, norm_kw), "o": (x, w_o, {}), "gate_up_norm": (x, w_gu, norm_kw),
                     "down_silu": (gu, w_down, dict(prologue="silu")),
                     "lm_head_argmax": (x, w_head, dict(out=logits, argmax=True))}
            for name, (xin, w, kw) in cases.items():
                t_fused = graph_time_per_call(functools.partial(small_gemm, xin, w, **kw))
                t_unfused = graph_time_per_call(functools.partial(unfused_chain, xin, w, **kw))
                gbps = w.numel() * w.element_size() / t_fused / 1e9
                entry: dict[str, Any] = {"fused_us": 1e6 * t_fused, "unfused_us": 1e6 * t_unfused,
                                         "fused_weight_gbps": gbps}
                if m == 1:
                    entry["gemv_us"] = 1e6 * graph_time_per_call(
                        functools.partial(small_gemm, xin, w, impl="gemv", **kw))
                    entry["plain_dot_us"] = 1e6 * graph_time_per_call(
                        functools.partial(unfused_chain, xin, w, small=True, **kw))
                    entry["plain_gemv_us"] = 1e6 * graph_time_per_call(
                        functools.partial(unfused_chain, xin, w, small=True, impl="gemv", **kw))
                    sweep = {}
                    for cfg in SMALL_GEMM_CONFIGS:
                        try:
                            t = graph_time_per_call(functools.partial(small_gemm, xin, w, config=cfg, **kw))
                            sweep["x".join(map(str, cfg))] = round(1e6 * t, 2)
                        except Exception as exc:  # a config the shape cannot take (e.g. out of shared memory)
                            sweep["x".join(map(str, cfg))] = f"error: {type(exc).__name__}"
                    entry["sweep_us"] = sweep
                timings[f"{label}_{name}_m{m}"] = entry
                print(f"small_gemm {label} {name} m={m}: " + json.dumps(entry), flush=True)
    report.record({"workload": "small_gemm_timings", **timings})


def kernel_table(fn: Callable[[], Any], reps: int) -> None:
    """GPU time per kernel over reps calls of fn (CUPTI also traces kernels inside graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60),
          flush=True)


# ---- workloads -------------------------------------------------------------------------------------------------
def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads: all but the input embedding (only a few rows are gathered)."""
    arch = engine.config.model.arch
    itemsize = engine.runner.dtype.itemsize
    embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return (arch.num_params - embedding) * itemsize


def counted_flops(engine: LLMEngine, prompt_len: int, out_len: int, num_seqs: int) -> float:
    """Linear layers on every token, lm_head on sampled rows, causal attention (QK and PV)."""
    arch = engine.config.model.arch
    lm_head = arch.vocab_size * arch.hidden_size
    linear = arch.num_params - lm_head - (0 if arch.tie_word_embeddings else lm_head)
    total_tokens = prompt_len + out_len
    per_seq = 2 * linear * total_tokens + 2 * lm_head * out_len
    per_seq += 4 * arch.num_layers * arch.num_heads * arch.head_dim * (total_tokens**2 / 2)
    return per_seq * num_seqs


def decode_workload(report: Report, name: str, engine: LLMEngine, hf: Any | None, prompt_len: int,
                    out_len: int, repeats: int, hf_out_len: int) -> None:
    arch = engine.config.model.arch
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    run_requests(engine, random_prompts(1, prompt_len, arch.vocab_size, seed=99), params)  # warm-up
    runs = [run_requests(engine, random_prompts(1, prompt_len, arch.vocab_size, seed=100 + r), params)
            for r in range(repeats)]
    best = min(runs, key=lambda r: r["elapsed"])
    out_tok_s = out_len / best["elapsed"]
    decode_tok_s = 1.0 / best["tpot"]
    avg_ctx = prompt_len + out_len / 2
    step_bytes = weight_bytes_per_step(engine) + avg_ctx * arch.kv_bytes_per_token(engine.runner.dtype.itemsize)
    ideal_tok_s = report.meta["copy_gbps"] * 1e9 / step_bytes
    rec = {"workload": name, "model_shapes": engine.config.model.model, "batch": 1, "prompt_len": prompt_len,
           "out_len": out_len, "kvflow_out_tok_s": out_tok_s, "kvflow_decode_tok_s": decode_tok_s,
           "kvflow_ttft_ms": best["ttft"] * 1e3, "kvflow_tpot_ms": best["tpot"] * 1e3,
           "kvflow_runs_s": [r["elapsed"] for r in runs], "step_bytes": step_bytes,
           "ideal_decode_tok_s": ideal_tok_s, "roofline_fraction": decode_tok_s / ideal_tok_s,
           "cuda_graphs": engine.runner.graphs is not None}
    graphs = engine.runner.graphs
    if graphs is not None:  # GPU time of one decode forward: step time minus this is host time
        graph = graphs.graphs[graphs.sizes[0]].graph  # forward + lm_head + argmax at batch 1
        rec["graph_replay_ms"] = cuda_time(graph.replay, 50) * 1e3
        rec["host_ms_per_step"] = best["tpot"] * 1e3 - rec["graph_replay_ms"]  # < 0 ms: host hidden by ahead
        rec["decode_ahead_hits"] = engine.runner.ahead_hits
        rec["decode_ahead_misses"] = engine.runner.ahead_misses
        if PROFILE_KERNELS:
            kernel_table(graph.replay, 20)
    if PROFILE_HOST:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        run_requests(engine, random_prompts(1, prompt_len, arch.vocab_size, seed=200), params)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(28)
    if hf is not None:
        prompt = random_prompts(1, prompt_len, arch.vocab_size, seed=100)
        hf_generate(hf, prompt, 8)  # warm-up
        _, _, hf_s = hf_generate(hf, prompt, hf_out_len)
        rec.update(hf_out_tok_s=hf_out_len / hf_s, hf_out_len=hf_out_len,
                   ratio=out_tok_s / (hf_out_len / hf_s))
    report.record(rec)


def hf_throughput(hf: Any, num_prompts: int, prompt_len: int, out_len: int, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(num_prompts, prompt_len, vocab, seed=7)
    hf_generate(hf, prompts[:2], 4)  # warm-up
    _, _, seconds = hf_generate(hf, prompts, out_len)
    return {"hf_out_tok_s": num_prompts * out_len / seconds, "hf_batch": num_prompts, "hf_seconds": seconds}


def throughput_workload(report: Report, name: str, engine: LLMEngine, num_prompts: int, prompt_len: int,
                        out_len: int, hf_rec: dict[str, Any] | None) -> None:
    arch = engine.config.model.arch
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    # Warm-up at the run's batch shapes (full prefill steps, mixed steps, decode beyond the captured sizes): the
    # Triton kernels specialize per shape class and compile on first use, which cost the first engine of a
    # process ~6 s of a 27 s run before (bench/GPU_NOTES.md).
    warm_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    warm = min(num_prompts, engine.config.scheduler.max_num_seqs + 64)
    run_requests(engine, random_prompts(warm, prompt_len, arch.vocab_size, seed=1), warm_params)
    res = run_requests(engine, random_prompts(num_prompts, prompt_len, arch.vocab_size, seed=2), params)
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
        prompt = random_prompts(1, tokens, arch.vocab_size, seed=500 + r)[0]
        engine.add_request(None, prompt, params, output_kind="final")
        torch.cuda.synchronize()
        started = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if r:
            times.append(time.perf_counter() - started)
    seconds = min(times)
    peak = report.meta["matmul_tflops"] * 1e12
    report.record({"workload": name, "model_shapes": engine.config.model.model, "prompt_tokens": tokens,
                   "steps": steps, "kvflow_prefill_s": seconds, "kvflow_prefill_tok_s": tokens / seconds,
                   "kvflow_runs_s": times, "mfu": tokens * 2 * arch.num_params / seconds / peak,
                   "mfu_counted": counted_flops(engine, tokens, 0, 1) / seconds / peak})


# ---- main ------------------------------------------------------------------------------------------------------
def guarded(report: Report, name: str, fn: Callable[[], None]) -> None:
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # one broken part must not hide the others' results
        traceback.print_exc()
        report.check(f"ran_{name}", False, f"{type(exc).__name__}: {exc}")
    release_memory()  # after the except block, which kept the failed frame (and its models) alive
    print(f"-- {name}: {time.perf_counter() - started:.1f}s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every workload at reduced size (smoke test)")
    parser.add_argument("--record", action="store_true", help="write bench/results/gpu_<device>.json")
    parser.add_argument("--only", nargs="*", default=None,
                        help="subset of: correctness qwen llama8b gemv decode_ab (default: all but decode_ab)")
    parser.add_argument("--ab", nargs="*", default=None, help="decode_ab variants to run (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = Report(os.environ.get("OUT"))
    import transformers
    import triton

    props = torch.cuda.get_device_properties(DEV)
    report.meta.update(device=torch.cuda.get_device_name(DEV), sm_count=props.multi_processor_count,
                       mem_gib=props.total_memory / 2**30, torch=torch.__version__, triton=triton.__version__,
                       transformers=transformers.__version__, cuda=torch.version.cuda, quick=args.quick)
    copy_bps, mm_flops = copy_bytes_per_s(), matmul_flops_per_s()
    torch.cuda.empty_cache()
    report.meta.update(copy_gbps=copy_bps / 1e9, matmul_tflops=mm_flops / 1e12)
    print("META " + json.dumps(report.meta), flush=True)
    parts = set(args.only or ["correctness", "gemv", "qwen", "llama8b"])

    def decode_ab() -> None:
        """Batch-1 decode A/B: the default, without programmatic dependent launch (KVFLOW_PDL=0), cuBLAS with
        separate norm/SwiGLU kernels (engine/models/llama.py SmallGemmMode), GEMVs without prologues, and the
        GEMV's load-streaming flags (KVFLOW_GEMV, kernels/small_gemm.py GemvConfig); --ab picks some."""
        variants = {"auto": {}, "auto_no_pdl": {"KVFLOW_PDL": "0"}, "cublas": {"KVFLOW_SMALL_GEMM": "0"},
                    "cublas_no_pdl": {"KVFLOW_SMALL_GEMM": "0", "KVFLOW_PDL": "0"},
                    "plain_gemv": {"KVFLOW_SMALL_GEMM": "plain"}, "gemv_none": {"KVFLOW_GEMV": "none"},
                    "gemv_pipelined": {"KVFLOW_GEMV": "pipelined"}, "gemv_prefetch": {"KVFLOW_GEMV": "prefetch"},
                    "gemv_pipelined_prefetch": {"KVFLOW_GEMV": "pipelined,prefetch"},
                    "gemv_all": {"KVFLOW_GEMV": "pipelined,prefetch,evict_first"},
                    "fused_norm": {"KVFLOW_SMALL_GEMM": "fused"}}
        unknown = set(args.ab or ()) - set(variants)
        if unknown:
            raise ValueError(f"unknown --ab variants {sorted(unknown)}; known: {sorted(variants)}")
        chosen = {k: v for k, v in variants.items() if not args.ab or k in args.ab}
        for preset, label, max_len, seqs in (("qwen2.5-0.5b", "qwen05b", 2048, 8),
                                             ("llama-3.1-8b", "llama8b", 8192 + 64, 256)):
            for variant, env in chosen.items():
                os.environ.update(env)
                try:
                    engine = build_engine(preset, max_model_len=max_len, max_num_seqs=seqs,
                                          enable_prefix_caching=False)
                    decode_workload(report, f"{label}_b1_decode_{variant}", engine, None, 128,
                                    64 if quick else 256, 2, 0)
                finally:
                    for key in env:
                        os.environ.pop(key)
                del engine
                release_memory()

    def gemv() -> None:
        from gpu_gemv import gemv_stream_record

        record, checks = gemv_stream_record()
        for name, ok, detail in checks:
            report.check(name, ok, detail)
        report.record({"device": report.meta["device"], **record})

    quick = args.quick

    def correctness() -> None:
        check_small_gemm(report)
        check_fused_kernels(report)
        prompts = [p[: 6 + 9 * i] for i, p in enumerate(random_prompts(4, 64, 500, seed=11))]
        for preset in ("tiny-llama", "tiny-qwen2", "tiny-qwen3"):
            check_vs_hf(report, preset, "float32", prompts, 24)
            check_vs_hf(report, preset, "bfloat16", prompts, 24)
        check_eager_vs_graphs(report, "tiny-llama", "float32")
        check_eager_vs_graphs(report, "tiny-qwen3", "float32")
        check_eager_vs_graphs(report, "tiny-llama", "bfloat16", across_batches=False)
        check_eager_vs_graphs(report, "tiny-qwen2", "bfloat16", across_batches=False)

    def qwen() -> None:
        hf = build_hf("qwen2.5-0.5b", torch.bfloat16)
        engine = build_engine("qwen2.5-0.5b", max_model_len=2048, max_num_seqs=8)
        load_hf_weights(engine, hf)
        prompts = random_prompts(2, 40, 151000, seed=5)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
        mine = run_requests(engine, prompts, params)
        for i, prompt in enumerate(prompts):
            theirs, logits, _ = hf_generate(hf, [prompt], 32, want_logits=True)
            assert logits is not None
            ours = mine["token_ids"][i]
            j = next((k for k in range(32) if ours[k] != theirs[0][k]), None)
            if j is None:
                report.check(f"hf_top5_divergence_qwen2.5-0.5b_bf16_{i}", True, "32/32 tokens identical")
            else:
                top5 = logits[j][0].topk(5).indices.tolist()
                report.check(f"hf_top5_divergence_qwen2.5-0.5b_bf16_{i}", ours[j] in top5,
                             f"first divergence at {j}: kvflow {ours[j]}, HF {theirs[0][j]} (HF top5 {top5})")
        out_len = 64 if quick else 256
        decode_workload(report, "qwen05b_b1_decode", engine, hf, 128, out_len, 2 if quick else 3,
                        64 if quick else 256)
        del engine, hf
        release_memory()

    def llama8b() -> None:
        num_prompts = 100 if quick else 1000
        hf = build_hf("llama-3.1-8b", torch.bfloat16)
        hf_b1 = random_prompts(1, 128, 128000, seed=100)
        hf_generate(hf, hf_b1, 8)
        hf_out = 32 if quick else 128
        _, _, hf_s = hf_generate(hf, hf_b1, hf_out)
        hf_b1_tok_s = hf_out / hf_s
        print(f"HF llama8b batch 1: {hf_b1_tok_s:.1f} tok/s", flush=True)
        hf_batch = hf_throughput(hf, 16 if quick else 64, 512, 32 if quick else 128, 128000)
        print(f"HF llama8b batch {hf_batch['hf_batch']}: {hf_batch['hf_out_tok_s']:.0f} out tok/s", flush=True)
        del hf
        release_memory()
        # The engine's own batch limits (vLLM's defaults: 1024 seqs / 16,384 batched tokens on >= 70 GiB GPUs).
        engine = build_engine("llama-3.1-8b", max_model_len=8192 + 64, enable_prefix_caching=False,
                              **(dict(max_num_seqs=64) if quick else {}))
        out_len = 64 if quick else 256
        decode_workload(report, "llama8b_b1_decode", engine, None, 128, out_len, 2, 0)
        rec = report.records[-1]
        rec.update(hf_out_tok_s=hf_b1_tok_s, hf_out_len=hf_out, ratio=rec["kvflow_out_tok_s"] / hf_b1_tok_s)
        report.save()
        print(f"llama8b_b1_decode vs HF: ratio {rec['ratio']:.2f}", flush=True)
        throughput_workload(report, "llama8b_1000", engine, num_prompts, 512, 128, hf_batch)
        prefill_workload(report, "llama8b_prefill_8k", engine, 8192, 2 if quick else 3)
        del engine
        release_memory()
        # Smaller batch limits for comparison (vLLM's on smaller GPUs, and a middle point).
        for seqs, tokens in ((256, 8192), (512, 16384)):
            engine = build_engine("llama-3.1-8b", max_model_len=8192 + 64, max_num_seqs=64 if quick else seqs,
                                  max_num_batched_tokens=tokens, enable_prefix_caching=False)
            throughput_workload(report, f"llama8b_1000_seqs{seqs}_tokens{tokens // 1024}k", engine, num_prompts,
                                512, 128, hf_batch)
            del engine
            release_memory()

    parts_in_order = (("correctness", correctness), ("gemv", gemv), ("qwen", qwen), ("llama8b", llama8b),
                      ("decode_ab", decode_ab))
    for name, fn in parts_in_order:
        if name in parts:
            guarded(report, name, fn)

    if args.record:
        slug = re.sub(r"[^A-Za-z0-9]+", "_", report.meta["device"]).strip("_").lower()
        path = ROOT / "bench" / "results" / f"gpu_{slug}.json"
        path.write_text(report.text())
        print(f"wrote {path}")
    print("\n== summary ==")
    for c in report.checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'} {c['check']}")
    for r in report.records:
        keys = ("kvflow_out_tok_s", "kvflow_decode_tok_s", "hf_out_tok_s", "ratio", "roofline_fraction", "mfu",
                "mfu_counted", "kvflow_prefill_s")
        print(r["workload"], " ".join(f"{k}={r[k]:.3g}" for k in keys if isinstance(r.get(k), float)))


if __name__ == "__main__":
    main()
