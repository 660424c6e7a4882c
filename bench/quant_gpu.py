#!/usr/bin/env python3
"""Quantization on the GPU (issue 14), each quantized form beside bf16 in the same run, Llama-3.1-8B shapes with
random weights (`--load-format dummy`):

- w8a8:  `--quantization fp8` vs bf16, engine throughput on N prompts x 512 in / 128 out (default N=1000; the
         lead may scale it down with --num-prompts), plus fp8 KV alone and fp8 weights + fp8 KV; the KV block
         count of each engine; and the Fp8Linear layer against its float32 reference at a real shape.
- kv:    paged decode attention, bf16 KV vs fp8 KV, at 8k and 32k context (batch 1 and 16), checked against the
         torch reference; and the block count of each KV dtype in one budget.
- int4:  the decode step's weight GEMMs (32 layers x qkv / o / gate_up / down, distinct weights, one CUDA graph)
         at batch 1, 8, 16, 64 and 256: Q4_1-style int4 (group 32) vs bf16 (cuBLAS); `int4` is the engine's CUDA path
         (the kn layout's GEMV / GEMM, kernels/quant_gemm_kn.py), `int4_canonical` the canonical layout's
         (kernels/quant_gemm.py); tok/s = batch / step time (weights only: no attention, no head).
- e2e:   SmolLM2 (its GGUF Q4_1) on the GPU: greedy ids of native int4 (`quantization="gguf"`) and of fp8 KV
         against the fp32-dequantized form with fp32 KV (exact matches; any divergence must be within top-5).

Writes bench/results/quant_gpu_<device>.json (fields: workload, device, numbers). `--smoke` runs the same code
paths on CPU at tiny shapes (Triton under its interpreter; fp8 W8A8 as the layer alone, since the engine refuses
fp8 weights on CPU) and writes bench/results/quant_gpu_smoke.json.

    python3 bench/quant_gpu.py                        # all parts on a GPU
    python3 bench/quant_gpu.py --parts w8a8 --num-prompts 256
    python3 bench/quant_gpu.py --smoke
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.quant.fp8_linear import Fp8Linear, fp8_matmul_ref  # noqa: E402
from engine.quant.group_quant import QuantWeight, fp16_bits, pack_int4, quant_matmul_ref  # noqa: E402
from engine.quant.kn_layout import KNWeight, from_kn, to_kn  # noqa: E402
from engine.quant.quant_layers import quant_matmul  # noqa: E402
from kernels.fp8_kv import quantize_fp8  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402

# Llama-3.1-8B
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 32, 8, 128


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def timed(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    """Median seconds per call (after one warm-up)."""
    fn()
    samples = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# ------------------------------------------------------------------------------------------------ fp8 W8A8
def part_w8a8(smoke: bool, num_prompts: int, only: list[str] | None = None) -> dict[str, Any]:
    from kvflow import LLM, SamplingParams

    dev = "cpu" if smoke else "cuda"
    n, k = (32, 64) if smoke else (INTER, HIDDEN)
    g = torch.Generator(device="cpu").manual_seed(0)
    dense = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_((torch.randn(n, k, generator=g) * 0.02).to(dev))
    layer = Fp8Linear.from_dense(dense)
    x = (torch.randn(64, k, generator=g)).to(dev, torch.bfloat16)
    record: dict[str, Any] = {"layer_rel_err_vs_ref": rel_err(layer(x), fp8_matmul_ref(x, layer.weight,
                                                                                        layer.weight_scale)),
                              "layer_rel_err_vs_bf16": rel_err(layer(x), dense(x))}
    model = "tiny" if smoke else "llama-3.1-8b"
    in_len, out_len = (16, 8) if smoke else (512, 128)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 500 if smoke else 120000) for _ in range(in_len)]}
               for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    configs = {"bf16": {}, "fp8_kv": {"kv_cache_dtype": "fp8"}}
    if not smoke:  # the engine refuses fp8 weights on CPU (the layer above ran there)
        configs |= {"fp8_w8a8": {"quantization": "fp8"},
                    "fp8_w8a8+fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
    runs: dict[str, Any] = {}
    for name, kw in configs.items():
        if only and name not in only and name != "bf16":
            continue
        llm = LLM(model, load_format="dummy", max_model_len=in_len + out_len + 16, **kw,
                  **({"device": "cpu", "kv_cache_memory_bytes": 16 << 20} if smoke else {}))
        blocks = llm.llm_engine.runner.kv_caches[0][0].shape[0]
        llm.generate(prompts[: min(8, num_prompts)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        runs[name] = {"output_tok_s": round(num_prompts * out_len / seconds, 1), "seconds": round(seconds, 2),
                      "kv_blocks": int(blocks)}
        print("w8a8", name, runs[name], flush=True)
        del llm
        if not smoke:
            torch.cuda.empty_cache()
    for r in runs.values():
        r["vs_bf16"] = round(r["output_tok_s"] / runs["bf16"]["output_tok_s"], 3)
        r["kv_blocks_vs_bf16"] = round(r["kv_blocks"] / runs["bf16"]["kv_blocks"], 3)
    record.update(workload=f"{model} dummy weights, {num_prompts} prompts x {in_len} in / {out_len} out, "
                           "ignore_eos, engine defaults", runs=runs)
    return record


def _cuda_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of fn (bench/gpu_gemv.py's timer)."""
    from bench.gpu_gemv import graph_seconds

    return graph_seconds(fn, reps) * 1e3


def part_w8a8_layers(smoke: bool) -> dict[str, Any]:
    """The four decoder linears of Llama-8B at prefill and decode row counts: Fp8Linear (activation quantization
    + _scaled_mm) vs bf16 F.linear, each over 8 distinct layers' weights in one CUDA graph; and the activation
    quantization alone, Triton (one launch) vs the torch reference (six kernels)."""
    from engine.quant.fp8_linear import quantize_per_token
    from kernels.fp8_quant import per_token_quant_fp8

    if smoke:
        return {"skipped": "GPU only (cuBLASLt fp8 GEMMs)"}
    shapes = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    layers = 8
    out: dict[str, Any] = {"workload": f"Llama-3.1-8B linears, {layers} layers of distinct weights per shape, "
                                       "CUDA graphs", "cases": []}
    for name, (n, k) in shapes.items():
        dense = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        fp8 = [Fp8Linear.from_dense(d) for d in dense]
        for m in (1, 64, 256, 2048, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                bf16_ms = _cuda_ms(lambda x=x, dense=dense: [d(x) for d in dense])
                fp8_ms = _cuda_ms(lambda x=x, fp8=fp8: [f(x) for f in fp8])
                quant_ms = _cuda_ms(lambda x=x: [per_token_quant_fp8(x) for _ in range(layers)])
                ref_ms = _cuda_ms(lambda x=x: [quantize_per_token(x) for _ in range(layers)])
            row = {"linear": name, "rows": m, "bf16_ms": round(bf16_ms / layers, 4),
                   "fp8_ms": round(fp8_ms / layers, 4), "fp8_speedup": round(bf16_ms / fp8_ms, 3),
                   "quant_triton_ms": round(quant_ms / layers, 4), "quant_torch_ms": round(ref_ms / layers, 4)}
            if m == 64:  # codes against the torch reference, with the hardware convert and with round_to_e4m3
                rq, rs = quantize_per_token(x)
                for label, hw in (("hw_cast", True), ("round_to_e4m3", False)):
                    q, sc = per_token_quant_fp8(x, hw_cast=hw)
                    diff = q.view(torch.uint8) != rq.view(torch.uint8)
                    row[f"quant_{label}"] = {
                        "codes_differing": int(diff.sum()), "scales_differing": int((sc != rs).sum()),
                        "examples": [{"x_over_scale": float(x[i, j].float() / rs[i]), "q": float(q[i, j]),
                                      "q_torch": float(rq[i, j])} for i, j in diff.nonzero()[:3].tolist()]}
            print("w8a8_layers", row, flush=True)
            out["cases"].append(row)
        del dense, fp8
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------- fp8 KV
def part_kv(smoke: bool) -> dict[str, Any]:
    dev = "cpu" if smoke else "cuda"
    heads, kv_heads, d, page = (4, 2, 32, 16) if smoke else (HEADS, KV_HEADS, HEAD_DIM, 16)
    contexts, batches = ([64, 128], [1, 2]) if smoke else ([8192, 32768], [1, 16])
    out: dict[str, Any] = {"workload": f"paged decode attention, H={heads}, Hkv={kv_heads}, D={d}, block {page}, "
                                       "kernel defaults, one launch per call in a CUDA graph (median of 50 replays)",
                           "cases": []}
    g = torch.Generator(device="cpu").manual_seed(1)
    for ctx in contexts:
        for batch in batches:
            blocks_per = ctx // page
            num_blocks = batch * blocks_per + 1
            tables = (torch.arange(batch * blocks_per, dtype=torch.int32) + 1).view(batch, blocks_per).to(dev)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(batch, heads, d, generator=g).to(dev, torch.bfloat16)
            shape = (num_blocks, page, kv_heads, d)
            kc = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
            vc = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
            k8, v8 = quantize_fp8(kc, 1.0), quantize_fp8(vc, 1.0)
            scale = d ** -0.5
            row: dict[str, Any] = {"context": ctx, "batch": batch}
            tickets = torch.zeros(batch * kv_heads, dtype=torch.int32, device=dev)
            for name, (kk, vv) in {"bf16": (kc, vc), "fp8": (k8, v8)}.items():
                # The engine's call: one launch (splits combined in-kernel), persistent tickets, in a CUDA graph.
                run = functools.partial(paged_decode_attention, q, kk, vv, tables, seq_lens, scale,
                                        max_seq_len=ctx, tickets=tickets)
                seconds = timed(run, 3, False) if smoke else _cuda_ms(run, 50) / 1e3
                row[f"{name}_us"] = round(seconds * 1e6, 1)
                if batch == batches[0] and ctx == contexts[0]:
                    ref = paged_decode_attention_ref(q, kk, vv, tables, seq_lens, scale)
                    row[f"{name}_rel_err"] = rel_err(run(), ref)
                kv_bytes = 2 * batch * ctx * kv_heads * d * kk.element_size()
                row[f"{name}_GBps"] = round(kv_bytes / row[f"{name}_us"] / 1e3, 1)
            row["fp8_speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
            print("kv", row, flush=True)
            out["cases"].append(row)
            del kc, vc, k8, v8
    budget = 8 << 30
    block = lambda itemsize: 2 * LAYERS * page * KV_HEADS * HEAD_DIM * itemsize  # noqa: E731
    out["blocks_in_8GiB_llama8b"] = {"bf16": budget // block(2), "fp8": budget // block(1)}
    return out


# --------------------------------------------------------------------------------------------------- int4
def _q4_weight(n: int, k: int, dev: str, g: torch.Generator) -> QuantWeight:
    """Random codes, scales and mins made where they are used (g lives on dev: 7 billion codes take minutes on
    the host)."""
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8, device=dev)
    return QuantWeight(4, "min", 32, n, k, pack_int4(q), fp16_bits(torch.rand(n, k // 32, generator=g, device=dev)
                                                                   * 0.002),
                       mins=fp16_bits(-torch.rand(n, k // 32, generator=g, device=dev) * 0.01))


def _kn_out(w: KNWeight, x: torch.Tensor, **overrides: Any) -> torch.Tensor:
    from engine.quant.group_quant import KINDS
    from kernels.quant_gemm_kn import quant_gemm_kn

    return quant_gemm_kn(x, w.qweight, w.scales, w.offsets, KINDS.index(w.kind), w.group_size, w.out_features,
                         **overrides)


def _triton_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The Triton kernel itself (what `quant_matmul` picks on CUDA), for the CPU smoke run under the interpreter."""
    from engine.quant.group_quant import KINDS
    from kernels.quant_gemm import quant_gemm

    return quant_gemm(x, w.qweight, w.scales, w.mins if w.mins is not None else w.zeros, w.bits,
                      KINDS.index(w.kind), w.group_size, w.out_features)


def _step_int4(weights: list[list[QuantWeight]], xs: dict[int, torch.Tensor], smoke: bool,
               tiled: dict[str, Any] | None = None, gemv: dict[str, Any] | None = None) -> None:
    """quant_matmul's own choice per batch; `tiled`: the dequantizing tensor-core GEMM (split K) with these
    keyword arguments, even where the GEMV would be taken (the A/B that sets GEMV_MAX_M, and the sweep)."""
    from engine.quant.group_quant import KINDS
    from kernels.quant_gemm import _quant_gemm_tiled, _quant_gemv

    for ws in weights:
        for w in ws:
            x = xs[w.in_features]
            if smoke:
                _triton_matmul(x, w)
            elif gemv is not None:
                y = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
                _quant_gemv(x, w.qweight, w.scales, w.mins, 4, KINDS.index(w.kind), w.group_size, w.out_features, y,
                            **gemv)
            elif tiled is not None:
                y = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
                _quant_gemm_tiled(x, w.qweight, w.scales, w.mins, 4, KINDS.index(w.kind), w.group_size,
                                  w.out_features, y, **tiled)
            else:
                quant_matmul(x, w)


def _arrivals(weights: list[list[KNWeight]]) -> list[list[torch.Tensor]]:
    """Each weight's split-arrival counters, as a QuantLinear holds them."""
    from kernels.quant_gemm_kn import new_arrivals

    return [[new_arrivals(w.out_features, w.qweight.device) for w in ws] for ws in weights]


def _step_kn(weights: list[list[KNWeight]], xs: dict[int, torch.Tensor], arrivals: list[list[torch.Tensor]] | None,
             **overrides: Any) -> None:
    """The engine's CUDA path for 4-bit weights: the kn layout's GEMV (1 row) / GEMM (more rows); `arrivals`: the
    one-row GEMV sums its K split in the same launch (as QuantLinear runs it), None: a second launch sums;
    `overrides`: quant_gemm_kn's sweep arguments."""
    from engine.quant.group_quant import KINDS
    from kernels.quant_gemm_kn import quant_gemm_kn

    for i, ws in enumerate(weights):
        for j, w in enumerate(ws):
            quant_gemm_kn(xs[w.in_features], w.qweight, w.scales, w.offsets, KINDS.index(w.kind), w.group_size,
                          w.out_features, arrivals=None if arrivals is None else arrivals[i][j], **overrides)


# The kn GEMM's tiles (BLOCK_M, BLOCK_N, BLOCK_R word rows, warps, SWAP_AB), and the dense path (dequantize W once,
# then cuBLAS). H100 rounds in quant_gpu_h100.json int4.kn_gemm_sweep: round 1 picked the tiles; round 2 found
# loading the codes one iteration ahead slower everywhere and the dequantization's tiles all within 4 %.
KN_GEMM_SWEEP: list[dict[str, Any]] = (
    [{"gemm_tiles": t, "dense": False} for t in ((16, 128, 16, 4, True), (32, 128, 16, 4, True),
                                                 (64, 128, 16, 4, True), (64, 128, 32, 4, True),
                                                 (64, 256, 16, 8, True), (128, 128, 16, 8, True))]
    + [{"dense": True}]
)


# The kn GEMV at batch 1: (BLOCK_N, NSUB, programs per SM, warps) x loads one iteration ahead.
KN_GEMV_SWEEP: list[dict[str, Any]] = [
    {"gemv_tiles": t, "pipeline": True, "sum_here": sh}
    for t in ((32, 4, 16, 1), (32, 4, 24, 1), (32, 4, 32, 1), (16, 8, 16, 1), (32, 8, 16, 1), (32, 4, 8, 1))
    for sh in (False, True)
]
# (earlier H100 rounds, kn_gemv_sweep.round_1 / round_2 in quant_gpu_h100.json: (32, 4, 16, 1) fastest of 20 tiles;
# loads one iteration ahead 2.27 vs 2.44 ms; round 3: the K split summed in the same launch or by a second one)
# The nibble-pair GEMV (`quant_gemm_kn(pairs=True)`) beside the single-nibble one at the same tiles. Offline sm_90
# SASS (bench/sass_mix.py -> int4_gemv_sass_offline.json, Triton 3.6 / 3.9) counts its loop at 6.5 / 4.8
# instructions per code against 7.6 / 7.2 at the default tiles, with more registers; narrower tiles are in too,
# and 24 programs per SM where the narrower tiles leave registers for them.
KN_PAIRS_SWEEP: list[dict[str, Any]] = [
    {"gemv_tiles": t, "pipeline": True, "sum_here": True, "pairs": pairs}
    for t in ((32, 4, 16, 1), (32, 4, 12, 1), (32, 2, 16, 1), (32, 2, 24, 1), (16, 4, 16, 1), (16, 8, 16, 1),
              (64, 2, 16, 1), (64, 2, 24, 1))
    for pairs in (False, True)
]


def _kn_gemv_sweep(kn: list[list[KNWeight]], bf16: list[list[torch.Tensor]], shapes: list[tuple[int, int]],
                   g: torch.Generator, configs: list[dict[str, Any]] = KN_GEMV_SWEEP) -> list[dict[str, Any]]:
    xs = {n: torch.randn(1, n, generator=g, device="cuda").to(torch.bfloat16) for n in {k for _, k in shapes}}
    bf16_ms = _graph_step_ms(functools.partial(_step_bf16, bf16, xs))
    w = kn[0][3]
    ref = quant_matmul_ref(xs[w.in_features].float(), from_kn(w))
    out = []
    arrivals = _arrivals(kn)
    for cfg in configs:
        rec: dict[str, Any] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}
        cfg = {k: v for k, v in cfg.items() if k != "sum_here"}
        step_arrivals = arrivals if rec["sum_here"] else None
        try:
            err = rel_err(_kn_out(w, xs[w.in_features], arrivals=None if step_arrivals is None
                                  else step_arrivals[0][3], **cfg).float(), ref)
            rec["rel_err"] = float(f"{err:.3g}")
            if err > 2e-2:
                rec["error"] = "wrong result"
            else:
                ms = _graph_step_ms(functools.partial(_step_kn, kn, xs, step_arrivals, **cfg))
                nbytes = sum(t.numel() * t.element_size() for ws in kn for w_ in ws
                             for t in (w_.qweight, w_.scales, w_.mins, w_.zeros) if t is not None)
                rec.update(step_ms=round(ms, 3), bf16_step_ms=round(bf16_ms, 3), vs_bf16=round(bf16_ms / ms, 3),
                           tb_s=round(nbytes / ms / 1e9, 3))
        except Exception as exc:  # a config that does not compile is recorded, not fatal
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print("kn_gemv_sweep", rec, flush=True)
        out.append(rec)
    return out


def _kn_gemm_sweep(kn: list[list[KNWeight]], bf16: list[list[torch.Tensor]], shapes: list[tuple[int, int]],
                   g: torch.Generator) -> list[dict[str, Any]]:
    out = []
    for batch in (8, 16, 32, 64, 128, 256):
        xs = {n: torch.randn(batch, n, generator=g, device="cuda").to(torch.bfloat16) for n in {k for _, k in shapes}}
        bf16_ms = _graph_step_ms(functools.partial(_step_bf16, bf16, xs))
        w = kn[0][3]
        ref = quant_matmul_ref(xs[w.in_features].float(), from_kn(w))
        for cfg in KN_GEMM_SWEEP:
            rec: dict[str, Any] = {"batch": batch, **{k: (list(v) if isinstance(v, tuple) else v)
                                                      for k, v in cfg.items()}}
            try:
                err = rel_err(_kn_out(w, xs[w.in_features], **cfg).float(), ref)
                rec["rel_err"] = float(f"{err:.3g}")
                if err > 2e-2:
                    rec["error"] = "wrong result"
                else:
                    ms = _graph_step_ms(functools.partial(_step_kn, kn, xs, None, **cfg))
                    rec.update(step_ms=round(ms, 3), bf16_step_ms=round(bf16_ms, 3), vs_bf16=round(bf16_ms / ms, 3))
            except Exception as exc:  # a config that does not compile is recorded, not fatal
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print("kn_gemm_sweep", rec, flush=True)
            out.append(rec)
    return out


def _graph_step_ms(fn: Callable[[], Any]) -> float:
    return _cuda_ms(fn, 10)


# The batch-1 GEMV's tiles (BLOCK_N rows, HALF: half the K elements per iteration, programs per SM) and warps:
# its default reads 1 KB per program per iteration (16 rows x 64 bytes); the bf16 GEMV that streams at ~3 TB/s
# reads 8 KB (4 rows x 1,024 weights).
GEMV_SWEEP: list[dict[str, Any]] = (
    [{}]
    + [{"tiles": t, "num_warps": w} for t, w in (((8, 128, 8), 4), ((4, 256, 8), 4), ((4, 512, 8), 4),
                                                 ((4, 512, 4), 8), ((8, 512, 4), 8), ((2, 512, 8), 4),
                                                 ((8, 128, 16), 4), ((8, 128, 4), 4), ((4, 128, 8), 4),
                                                 ((8, 64, 8), 4), ((8, 128, 8), 2), ((4, 128, 16), 2),
                                                 ((8, 128, 12), 4), ((16, 128, 8), 8), ((8, 256, 8), 8),
                                                 ((4, 256, 8), 2))]
)
GEMM_SWEEP: list[dict[str, Any]] = (
    [{"meta_per_sub": False, "swap_ab": False, "tiles": (64, 64, 4), "num_warps": 4}, {}]  # before, the defaults
    + [{"swap_ab": True, "tiles": t, "num_warps": w} for t in ((16, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 4),
                                                              (64, 128, 2), (64, 256, 2))
       for w in (4, 8)]
    + [{"swap_ab": False, "tiles": (64, 128, 4), "num_warps": w} for w in (4, 8)]
    + [{"swap_ab": True, "tiles": (64, 128, 2), "num_warps": 8, "num_stages": st} for st in (2, 4)]
)


def _step_bf16(weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    for ws in weights:
        for w in ws:
            F.linear(xs[w.shape[1]], w)


def _step_bf16_engine(weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    """The engine's own bf16 path for one row (kernels/small_gemm.py's GEMV, as engine/models/llama.py calls it,
    without the norm / SwiGLU prologues it fuses there): faster than cuBLAS at batch 1, so the fairer baseline."""
    from kernels.small_gemm import small_gemm

    for ws in weights:
        for w in ws:
            small_gemm(xs[w.shape[1]], w, impl="gemv")


def part_int4(smoke: bool, sweeps: tuple[str, ...] = ("gemv", "gemm")) -> dict[str, Any]:
    dev = "cpu" if smoke else "cuda"
    hidden, inter, layers = (64, 128, 2) if smoke else (HIDDEN, INTER, LAYERS)
    q_out = hidden + 2 * (hidden // 4)  # Llama-8B: 4096 + 2 x 1024
    shapes = [(q_out, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    g = torch.Generator(device=dev).manual_seed(2)
    int4 = [[_q4_weight(n, k, dev, g) for n, k in shapes] for _ in range(layers)]
    bf16 = [[torch.randn(n, k, generator=g, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
            for _ in range(layers)]
    kn = [[to_kn(w) for w in ws] for ws in int4]
    kn_arrivals = _arrivals(kn)
    x = torch.randn(8, hidden, generator=g, device=dev).to(torch.bfloat16)
    check = (_triton_matmul if smoke else quant_matmul)(x, int4[0][2])
    ref = quant_matmul_ref(x.float(), int4[0][2])
    kn_check = {}
    for rows in (1, 8):
        xs_c = {hidden: x[:rows].contiguous()}
        kn_check[rows] = rel_err(_kn_out(kn[0][2], xs_c[hidden]).float(), ref[:rows])
    out: dict[str, Any] = {
        "workload": f"decode-step weight GEMMs, {layers} layers x {shapes} (distinct weights), "
                    "int4 Q4_1-style group 32 vs bf16; int4 = the engine's CUDA path (kn layout, "
                    "kernels/quant_gemm_kn.py), int4_canonical = kernels/quant_gemm.py over the canonical layout; "
                    "bf16 = cuBLAS (F.linear), bf16_engine (batch 1) = the engine's own bf16 GEMV "
                    "(kernels/small_gemm.py)",
        "check_rel_err_vs_ref": rel_err(check.float(), ref),
        "kn_check_rel_err_vs_ref": kn_check,
        "kn_round_trip_exact": all(torch.equal(from_kn(k).qweight, w.qweight) for k, w in zip(kn[0], int4[0],
                                                                                            strict=True)),
        "weight_bytes": {"int4": sum(w.nbytes for ws in int4 for w in ws),
                         "bf16": sum(w.numel() * 2 for ws in bf16 for w in ws)},
        "cases": [],
    }
    for batch in (1, 8, 16, 64, 256):
        xs = {n: torch.randn(batch, n, generator=g, device=dev).to(torch.bfloat16) for n in {k for _, k in shapes}}

        row: dict[str, Any] = {"batch": batch}
        steps = [("bf16", functools.partial(_step_bf16, bf16, xs)),
                 ("int4", functools.partial(_step_kn, kn, xs, kn_arrivals)),
                 ("int4_canonical", functools.partial(_step_int4, int4, xs, smoke))]
        if batch in (1, 8) and not smoke and sweeps:
            steps.append(("int4_tiled_gemm", functools.partial(_step_int4, int4, xs, smoke, {})))
        if batch == 1 and dev == "cuda":  # (at 2+ rows the engine's bf16 linears are cuBLAS: the bf16 row)
            steps.append(("bf16_engine", functools.partial(_step_bf16_engine, bf16, xs)))
        for name, fn in steps:
            run = fn
            if dev == "cuda":  # one graph per step: launch overhead out of the comparison
                fn()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                run = graph.replay
            seconds = timed(run, 2 if smoke else 20, dev == "cuda")
            row[f"{name}_step_ms"] = round(seconds * 1e3, 3)
            row[f"{name}_tok_s"] = round(batch / seconds, 1)
        row["int4_vs_bf16"] = round(row["int4_tok_s"] / row["bf16_tok_s"], 3)
        row["int4_canonical_vs_bf16"] = round(row["int4_canonical_tok_s"] / row["bf16_tok_s"], 3)
        if "bf16_engine_tok_s" in row:
            row["int4_vs_bf16_engine"] = round(row["int4_tok_s"] / row["bf16_engine_tok_s"], 3)
        if "int4_tiled_gemm_tok_s" in row:
            row["int4_tiled_gemm_vs_bf16"] = round(row["int4_tiled_gemm_tok_s"] / row["bf16_tok_s"], 3)
        print("int4", row, flush=True)
        out["cases"].append(row)
    if not smoke and sweeps:  # the GEMV's tiles at batch 1, the GEMM's variants and tiles at larger batches
        from engine.quant.group_quant import KINDS
        from kernels.quant_gemm import _quant_gemm_tiled, _quant_gemv

        out["gemv_sweep"] = []
        xs = {n: torch.randn(1, n, generator=g, device=dev).to(torch.bfloat16) for n in {k for _, k in shapes}}
        bf16_ms = _graph_step_ms(functools.partial(_step_bf16, bf16, xs))
        for cfg in GEMV_SWEEP if "gemv" in sweeps else []:
            rec = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}
            try:
                w = int4[0][0]
                check = torch.empty(1, w.out_features, dtype=torch.bfloat16, device=dev)
                _quant_gemv(xs[w.in_features], w.qweight, w.scales, w.mins, 4, KINDS.index(w.kind), w.group_size,
                            w.out_features, check, **cfg)
                err = rel_err(check.float(), quant_matmul_ref(xs[w.in_features].float(), w))
                if err > 2e-2:
                    rec["error"] = f"rel err {err:.3g}"
                else:
                    ms = _graph_step_ms(functools.partial(_step_int4, int4, xs, smoke, None, cfg))
                    rec.update(step_ms=round(ms, 3), bf16_step_ms=round(bf16_ms, 3), vs_bf16=round(bf16_ms / ms, 3))
            except Exception as exc:  # a config that does not compile is recorded, not fatal
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            print("int4_gemv_sweep", rec, flush=True)
            out["gemv_sweep"].append(rec)
        out["gemm_sweep"] = []
        for batch in (1, 8, 16, 64, 256) if "gemm" in sweeps else ():
            xs = {n: torch.randn(batch, n, generator=g, device=dev).to(torch.bfloat16) for n in {k for _, k in shapes}}
            bf16_ms = _graph_step_ms(functools.partial(_step_bf16, bf16, xs))
            for cfg in GEMM_SWEEP:
                rec: dict[str, Any] = {"batch": batch, **{k: (list(v) if isinstance(v, tuple) else v)
                                                          for k, v in cfg.items()}}
                try:
                    w = int4[0][2]
                    check = torch.empty(batch, w.out_features, dtype=torch.bfloat16, device=dev)
                    _quant_gemm_tiled(xs[w.in_features], w.qweight, w.scales, w.mins, 4, KINDS.index(w.kind),
                                      w.group_size, w.out_features, check, **cfg)
                    err = rel_err(check.float(), quant_matmul_ref(xs[w.in_features].float(), w))
                    if err > 2e-2:
                        rec["error"] = f"rel err {err:.3g}"
                    else:
                        ms = _graph_step_ms(functools.partial(_step_int4, int4, xs, smoke, cfg))
                        rec.update(step_ms=round(ms, 3), bf16_step_ms=round(bf16_ms, 3),
                                   vs_bf16=round(bf16_ms / ms, 3))
                except Exception as exc:  # a variant that does not compile is recorded, not fatal
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                print("int4_gemm_sweep", rec, flush=True)
                out["gemm_sweep"].append(rec)
    if not smoke and "kngemv" in sweeps:
        out["kn_gemv_sweep"] = _kn_gemv_sweep(kn, bf16, shapes, g)
    if not smoke and "pairs" in sweeps:
        out["kn_pairs_sweep"] = _kn_gemv_sweep(kn, bf16, shapes, g, KN_PAIRS_SWEEP)
    if not smoke and "kngemm" in sweeps:
        out["kn_gemm_sweep"] = _kn_gemm_sweep(kn, bf16, shapes, g)
    return out


# ------------------------------------------------------------------------------------------- SmolLM2 e2e
def part_e2e(smoke: bool) -> dict[str, Any]:
    from kvflow import LLM, SamplingParams
    from tests.helpers.oracle import PROMPTS

    kw: dict[str, Any] = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
    if smoke:
        kw["device"] = "cpu"
    oracle = LLM("smollm2", **kw)
    tok = oracle.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(p).input_ids} for p in (PROMPTS[:3] if smoke else PROMPTS)]
    want = oracle.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=5))
    del oracle
    result: dict[str, Any] = {"workload": f"SmolLM2 GGUF Q4_1, {len(prompts)} prompts x 16 greedy tokens, vs the "
                                          "fp32-dequantized form with fp32 KV"}
    for name, extra in {"int4_gguf": {"quantization": "gguf"}, "fp8_kv": {"kv_cache_dtype": "fp8"}}.items():
        llm = LLM("smollm2", **kw, **extra)
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        exact, within_top5 = 0, 0
        for w, h in zip(want, got, strict=True):
            ours, theirs = h.outputs[0].token_ids, w.outputs[0].token_ids
            if ours == theirs:
                exact += 1
                continue
            i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
            within_top5 += ours[i] in w.outputs[0].logprobs[i]
        result[name] = {"exact": exact, "diverged_within_top5": within_top5, "prompts": len(prompts)}
        print("e2e", name, result[name], flush=True)
        del llm
    return result


def part_awq_e2e(smoke: bool) -> dict[str, Any]:
    """A tiny AWQ / GPTQ checkpoint (round-to-nearest, built as tests/engine/test_quant_awq_gptq.py does) through the
    engine on this device: 4-bit linears in the kn layout on CUDA, greedy ids against the dense checkpoint of the
    same dequantized weights (fp32, and bf16 beside a bf16 dense run)."""
    import tempfile

    from tests.test_quant_awq_gptq import build

    from engine.arg_utils import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.quant.quant_layers import QuantLinear
    from engine.sampling_params import SamplingParams

    device = "cpu" if smoke else "cuda"
    prompts = [[5, 17, 300, 42], [7] * 20, list(range(100, 140)), [1, 2, 3] * 30]
    result: dict[str, Any] = {"workload": f"tiny Llama preset, AWQ/GPTQ group 32, {len(prompts)} prompts x 16 "
                                          "greedy tokens vs the dense checkpoint of the same weights"}

    def run(path: Path, dtype: str, logprobs: int | None) -> tuple[LLMEngine, list[Any]]:
        eng = LLMEngine(EngineArgs(model=str(path), device=device, dtype=dtype, kv_cache_memory_bytes=64 << 20,
                                   max_model_len=256).create_engine_config())
        for n, prompt in enumerate(prompts):
            eng.add_request(f"r{n}", prompt, SamplingParams(max_tokens=16, temperature=0, logprobs=logprobs))
        outs: dict[str, Any] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0]
        return eng, [outs[f"r{n}"] for n in range(len(prompts))]

    with tempfile.TemporaryDirectory() as tmp:
        for method in ("awq", "gptq"):
            qpath, dpath, _ = build(Path(tmp) / method, method)
            for dtype in ("float32", "bfloat16"):
                eng, ours = run(qpath, dtype, None)
                layouts = sorted({m.layout for m in eng.runner.model.modules() if isinstance(m, QuantLinear)})
                del eng
                _, want = run(dpath, dtype, 5)
                exact = sum(o.token_ids == w.token_ids for o, w in zip(ours, want, strict=True))
                top5 = 0
                for o, w in zip(ours, want, strict=True):
                    if o.token_ids != w.token_ids:
                        k = next(j for j, (a, b) in enumerate(zip(o.token_ids, w.token_ids, strict=False)) if a != b)
                        top5 += o.token_ids[k] in w.logprobs[k]
                result[f"{method}_{dtype}"] = {"layouts": layouts, "exact": exact, "diverged_within_top5": top5,
                                               "prompts": len(prompts)}
                print("awq_e2e", method, dtype, result[f"{method}_{dtype}"], flush=True)
    return result


PARTS = {"awq_e2e": part_awq_e2e, "w8a8": part_w8a8, "w8a8_layers": part_w8a8_layers, "kv": part_kv, "int4": part_int4, "e2e": part_e2e}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--int4-sweeps", nargs="*", default=["gemv", "gemm"], choices=["gemv", "gemm", "kngemv", "kngemm", "pairs"],
                        help="int4: which tile sweeps to run after the cases (none: no sweep)")
    parser.add_argument("--w8a8-configs", nargs="+", default=None,
                        help="w8a8: only these engines beside bf16 (fp8_kv, fp8_w8a8, fp8_w8a8+fp8_kv)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke on CPU")
    record: dict[str, Any] = {"device": device_name(), "torch": torch.__version__, "smoke": args.smoke}
    for part in args.parts:
        try:
            if part == "w8a8":
                record[part] = part_w8a8(args.smoke, 4 if args.smoke else args.num_prompts, args.w8a8_configs)
            elif part == "int4":
                record[part] = part_int4(args.smoke, tuple(args.int4_sweeps))
            else:
                record[part] = PARTS[part](args.smoke)  # type: ignore[operator]
        except Exception as exc:  # record the failure and go on with the other parts
            traceback.print_exc()
            record[part] = {"error": f"{type(exc).__name__}: {exc}"}
    tag = "smoke" if args.smoke else device_name().lower().replace(" ", "_")
    out = args.out or ROOT / "bench" / "results" / f"quant_gpu_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    if any("error" in v for v in record.values() if isinstance(v, dict)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
