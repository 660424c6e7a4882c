"""Check and time every kernel in kernels/ on a CUDA GPU at real model shapes.

Order of work (METHOD.md): print the device and versions; measure the two ceilings (a large device-to-device
copy, counting bytes read + written, and a bf16 matmul); then for each kernel and shape: poison the output with
NaN, run once, compare with the plain torch reference in float64 by ||out - ref|| / ||ref||, and time with
``triton.testing.do_bench`` (median; it flushes L2 before every repetition, so the numbers are cold-cache).
Achieved GB/s counts the fewest bytes the kernel must move (each input read once, each output written once);
roofline fraction = achieved GB/s / measured copy GB/s.

Full results go to $OUT/gpu_kernels.json when OUT is set and to bench/results/gpu_kernels_<device>.json with
--record; a short table is printed last.

    PYTHONUNBUFFERED=1 python -m bench.gpu_kernels --record
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

from bench.harness.ceilings import copy_bytes_per_s, matmul_flops_per_s
from bench.harness.records import RESULTS, device_slug
from bench.harness.timing import capture_graph
from kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from kernels.paged_decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

MODELS: dict[str, dict[str, int]] = {
    "llama3.1-8b": {"H": 32, "Hkv": 8, "D": 128, "hidden": 4096, "inter": 14336},
    "qwen2.5-0.5b": {"H": 14, "Hkv": 2, "D": 64, "hidden": 896, "inter": 4864},
}
# METHOD.md: fp32 arithmetic lands far under 1e-3; bf16 operands between 1e-3 and 1e-2.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
PAGE = 16
DEV = torch.device("cuda")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")  # unwritten (NaN-poisoned) or non-finite output never passes
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def median_ms(fn: Callable[[], Any], rep: int = 60) -> float:
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def graph_ms(fn: Callable[[], Any]) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: GPU time without Python launch cost
    (the engine replays decode steps from graphs). do_bench still flushes L2 before each replay."""
    return median_ms(capture_graph(fn).replay)


def make_paged(lens: list[int], hkv: int, d: int, dtype: torch.dtype, g: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches filled with random data and shuffled (non-contiguous) block tables."""
    need = [max(1, -(-n // PAGE)) for n in lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g, device="cpu")
    bt = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        bt[i, :k] = perm[used : used + k].int()
        used += k
    kc = torch.randn((num_blocks, PAGE, hkv, d), device=DEV, dtype=dtype)
    vc = torch.randn((num_blocks, PAGE, hkv, d), device=DEV, dtype=dtype)
    return kc, vc, bt.to(DEV)


def sub_cache(kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, sel: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 copy of only the pages the selected sequences use, with remapped tables."""
    rows = bt[sel].long()
    uniq, inv = torch.unique(rows, return_inverse=True)
    return kc[uniq].double(), vc[uniq].double(), inv.view(rows.shape).int()


def check_rows(n: int, k: int = 8) -> torch.Tensor:
    return torch.unique(torch.cat([torch.arange(min(k, n)), torch.arange(max(0, n - k), n)])).to(DEV)


class KernelBench:
    """The run's ceilings, time budget and result rows; each case method checks, times and records one shape."""

    def __init__(self, budget_s: float) -> None:
        self.results: list[dict[str, Any]] = []
        self.copy_gbps = self.matmul_tflops = float("nan")
        self.deadline = time.time() + budget_s

    def measure_ceilings(self) -> None:
        timer = lambda fn: median_ms(fn, rep=100) / 1e3  # noqa: E731
        self.copy_gbps = copy_bytes_per_s(torch.randn(1 << 29, device=DEV, dtype=torch.bfloat16), timer) / 1e9
        self.matmul_tflops = matmul_flops_per_s(8192, timer) / 1e12
        torch.cuda.empty_cache()
        print(f"copy bandwidth (read+write, 1 GiB): {self.copy_gbps:.0f} GB/s; "
              f"bf16 matmul 8192^3: {self.matmul_tflops:.0f} TFLOP/s", flush=True)

    def out_of_time(self, section: str) -> bool:
        if time.time() > self.deadline:
            print(f"  [skipped {section}: time budget spent]", flush=True)
            self.results.append({"kernel": section, "skipped": "time budget"})
            return True
        return False

    def record(self, kernel: str, model: str, dtype: str, shape: str, ms: float, nbytes: float, err: float,
               flops: float = 0.0, **extra: Any) -> None:
        tol = TOL[DT[dtype]] if dtype in DT else 0.0
        row = {"kernel": kernel, "model": model, "dtype": dtype, "shape": shape, "time_us": ms * 1e3,
               "bytes": nbytes, "gbps": nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan"),
               "tflops": flops / (ms * 1e-3) / 1e12 if ms > 0 and flops else None, "rel_err": err, "tol": tol,
               "ok": bool(err == err and err < tol), **extra}
        row["roofline"] = row["gbps"] / self.copy_gbps
        if extra.get("graph_us"):
            row["graph_gbps"] = nbytes / (extra["graph_us"] * 1e-6) / 1e9
            row["graph_roofline"] = row["graph_gbps"] / self.copy_gbps
        if row["tflops"] is not None:
            row["mm_frac"] = row["tflops"] / self.matmul_tflops
        self.results.append(row)
        tf = f" {row['tflops']:7.1f} TF/s" if row["tflops"] is not None else ""
        if row.get("graph_us"):
            tf += f" | graph {row['graph_us']:8.1f} us {100 * row['graph_roofline']:5.1f}%"
        print(f"  {kernel:<16} {model:<13} {dtype:<4} {shape:<30} {row['time_us']:9.1f} us "
              f"{row['gbps']:8.1f} GB/s {100 * row['roofline']:5.1f}%{tf}  err {err:.2e} "
              f"{'ok' if row['ok'] else 'FAIL'}", flush=True)

    # ---- attention -------------------------------------------------------------------------------------------
    def decode_case(self, model: str, dtype_name: str, batch: int, ctx: int | list[int], g: torch.Generator,
                    variants: list[dict[str, int]] | None = None, tag: str = "") -> None:
        if self.out_of_time("decode_case"):
            return
        cfg, dtype = MODELS[model], DT[dtype_name]
        lens = ctx if isinstance(ctx, list) else [ctx] * batch
        kc, vc, bt = make_paged(lens, cfg["Hkv"], cfg["D"], dtype, g)
        sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn((batch, cfg["H"], cfg["D"]), device=DEV, dtype=dtype)
        scale = cfg["D"] ** -0.5
        es = dtype.itemsize
        nbytes = sum(lens) * cfg["Hkv"] * cfg["D"] * 2 * es + 2 * q.numel() * es + bt.numel() * 4
        sel = check_rows(batch)
        kr, vr, btr = sub_cache(kc, vc, bt, sel)
        ref = paged_decode_attention_ref(q[sel].double(), kr, vr, btr, sl[sel], scale)
        shape = f"B={batch} ctx={'mixed' if isinstance(ctx, list) else ctx}{tag}"
        for var in variants or [{"max_seq_len": max(lens)}]:
            out = torch.full_like(q, float("nan"))

            def call(var: dict[str, int] = var, out: torch.Tensor = out) -> None:
                paged_decode_attention(q, kc, vc, bt, sl, scale, out=out, **var)

            call()
            torch.cuda.synchronize()
            err = rel_err(out[sel], ref) if torch.isfinite(out).all() else float("nan")
            ms, gms = median_ms(call), graph_ms(call)
            splits = var.get("num_splits", default_num_splits(batch, cfg["Hkv"], DEV, var.get("max_seq_len")))
            vtxt = "".join(f" {k[:3]}={v}" for k, v in var.items() if k not in ("num_splits", "max_seq_len"))
            self.record("decode_attn", model, dtype_name, f"{shape} s={splits}{vtxt}", ms, nbytes, err,
                        graph_us=gms * 1e3, **var)

    def decode_graph_check(self, g: torch.Generator) -> None:
        """The launcher must be CUDA-graph capturable (no host sync) and give the same output."""
        cfg = MODELS["llama3.1-8b"]
        lens = torch.randint(1, 4096, (48,), generator=g).tolist()
        kc, vc, bt = make_paged(lens, cfg["Hkv"], cfg["D"], torch.bfloat16, g)
        sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn((48, cfg["H"], cfg["D"]), device=DEV, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        eager = paged_decode_attention(q, kc, vc, bt, sl, 0.088, num_splits=4)
        graph = capture_graph(lambda: paged_decode_attention(q, kc, vc, bt, sl, 0.088, out=out, num_splits=4))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(out, eager))
        nbytes = sum(lens) * cfg["Hkv"] * cfg["D"] * 2 * 2 + 2 * q.numel() * 2
        print(f"  CUDA graph capture/replay of decode (B=48 mixed, s=4): identical={same}", flush=True)
        self.record("decode_graph", "llama3.1-8b", "bf16", "B=48 ctx=mixed s=4 graph", median_ms(graph.replay),
                    nbytes, 0.0 if same else 1.0)

    def prefill_case(self, model: str, dtype_name: str, q_lens: list[int], prefixes: list[int], g: torch.Generator,
                     tag: str, sdpa: bool = False, variants: list[dict[str, int]] | None = None) -> None:
        if self.out_of_time("prefill_case"):
            return
        cfg, dtype = MODELS[model], DT[dtype_name]
        h, hkv, d = cfg["H"], cfg["Hkv"], cfg["D"]
        lens = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
        kc, vc, bt = make_paged(lens, hkv, d, dtype, g)
        cu_list = [0]
        for n in q_lens:
            cu_list.append(cu_list[-1] + n)
        cu = torch.tensor(cu_list, dtype=torch.int32, device=DEV)
        sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn((cu_list[-1], h, d), device=DEV, dtype=dtype)
        scale = d**-0.5
        flops = sum(4.0 * h * d * (n * p + n * (n + 1) / 2) for n, p in zip(q_lens, prefixes, strict=True))
        nbytes = 2 * q.numel() * dtype.itemsize + sum(lens) * hkv * d * 2 * dtype.itemsize
        sel = sorted({0, min(1, len(q_lens) - 1), len(q_lens) - 1})  # reference on a few sequences
        sel_t = torch.tensor(sel, device=DEV)
        kr, vr, btr = sub_cache(kc, vc, bt, sel_t)
        cur = [0]
        for i in sel:
            cur.append(cur[-1] + q_lens[i])
        ref = paged_prefill_attention_ref(torch.cat([q[cu_list[i] : cu_list[i + 1]] for i in sel]).double(), kr, vr,
                                          btr, torch.tensor(cur, dtype=torch.int32, device=DEV), sl[sel_t], scale)
        for var in variants or [{}]:
            out = torch.full_like(q, float("nan"))

            def call(var: dict[str, int] = var, out: torch.Tensor = out) -> None:
                paged_prefill_attention(q, kc, vc, bt, cu, sl, scale, out=out, max_q_len=max(q_lens), **var)

            call()
            torch.cuda.synchronize()
            o_sel = torch.cat([out[cu_list[i] : cu_list[i + 1]] for i in sel])
            err = rel_err(o_sel, ref) if torch.isfinite(out).all() else float("nan")
            vtxt = "".join(f" {k.split('_')[-1][:1]}{k[:1]}={v}" for k, v in var.items())
            self.record("prefill_attn", model, dtype_name, tag + vtxt, median_ms(call), nbytes, err, flops=flops,
                        **var)
        if sdpa and len(q_lens) == 1 and prefixes[0] == 0:
            # Yardstick: torch's fused causal attention on dense (unpaged) tensors of the same problem.
            n = q_lens[0]
            qd = q.transpose(0, 1).unsqueeze(0)
            kd = torch.randn((1, hkv, n, d), device=DEV, dtype=dtype)
            vd = torch.randn((1, hkv, n, d), device=DEV, dtype=dtype)
            fn = torch.nn.functional.scaled_dot_product_attention
            ms = median_ms(lambda: fn(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True))
            self.record("torch_sdpa", model, dtype_name, tag + " dense", ms, nbytes, 0.0, flops=flops)

    # ---- elementwise -----------------------------------------------------------------------------------------
    def kv_write_case(self, model: str, dtype_name: str, tokens: int, g: torch.Generator) -> None:
        if self.out_of_time("kv_write_case"):
            return
        hkv, d, dtype = MODELS[model]["Hkv"], MODELS[model]["D"], DT[dtype_name]
        num_blocks = tokens // PAGE + 64
        key = torch.randn((tokens, hkv, d), device=DEV, dtype=dtype)
        value = torch.randn((tokens, hkv, d), device=DEV, dtype=dtype)
        slots = torch.randperm(num_blocks * PAGE, generator=g)[:tokens].to(DEV)
        slots[::97] = -1
        kc = torch.full((num_blocks, PAGE, hkv, d), float("nan"), device=DEV, dtype=dtype)
        vc = torch.full_like(kc, float("nan"))
        kr, vr = kc.clone(), vc.clone()
        write_kv_cache(key, value, kc, vc, slots)
        write_kv_cache_ref(key, value, kr, vr, slots)
        torch.cuda.synchronize()
        same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in ((kc, kr), (vc, vr)))
        nbytes = 4 * int((slots >= 0).sum()) * hkv * d * dtype.itemsize + tokens * 8
        ms = median_ms(lambda: write_kv_cache(key, value, kc, vc, slots))
        self.record("kv_write", model, dtype_name, f"T={tokens}", ms, nbytes, 0.0 if same else 1.0)

    def rms_case(self, model: str, dtype_name: str, tokens: int, g: torch.Generator) -> None:
        if self.out_of_time("rms_case"):
            return
        n, dtype = MODELS[model]["hidden"], DT[dtype_name]
        es = dtype.itemsize
        x = torch.randn((tokens, n), device=DEV, dtype=dtype)
        w = torch.randn((n,), device=DEV, dtype=dtype)
        out = torch.full_like(x, float("nan"))
        rms_norm(x, w, 1e-6, out=out)
        err = rel_err(out, rms_norm_ref(x.double(), w.double(), 1e-6))
        ms = median_ms(lambda: rms_norm(x, w, 1e-6, out=out))
        self.record("rms_norm", model, dtype_name, f"T={tokens} N={n}", ms, 2 * x.numel() * es + n * es, err)
        r = torch.randn((tokens, n), device=DEV, dtype=dtype)
        xr, rr = x.double(), r.double()
        fused_add_rms_norm_ref(xr, rr, w.double(), 1e-6)
        fused_add_rms_norm(x, r, w, 1e-6)
        err = max(rel_err(x, xr), rel_err(r, rr))
        ms = median_ms(lambda: fused_add_rms_norm(x, r, w, 1e-6))  # in place: values drift, shapes don't
        self.record("fused_add_rms", model, dtype_name, f"T={tokens} N={n}", ms, 4 * x.numel() * es + n * es, err)

    def rotary_case(self, model: str, dtype_name: str, tokens: int, g: torch.Generator) -> None:
        if self.out_of_time("rotary_case"):
            return
        cfg, dtype = MODELS[model], DT[dtype_name]
        h, hkv, d = cfg["H"], cfg["Hkv"], cfg["D"]
        qkv = torch.randn((tokens, (h + 2 * hkv) * d), device=DEV, dtype=dtype)
        q, k = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d]  # views into the fused projection
        cache = build_cos_sin_cache(32768, d, base=500000.0, device=DEV)
        pos = torch.randint(0, 32768, (tokens,), generator=g).to(DEV)
        qr, kr = q.double(), k.double()
        rotary_embedding_ref(pos, qr, kr, cache.double())
        rotary_embedding(pos, q, k, cache)
        err = max(rel_err(q, qr), rel_err(k, kr))
        nbytes = 2 * (q.numel() + k.numel()) * dtype.itemsize + tokens * (d * 4 + 8)
        ms = median_ms(lambda: rotary_embedding(pos, q, k, cache))
        self.record("rotary", model, dtype_name, f"T={tokens} q+k in place", ms, nbytes, err)

    def silu_case(self, model: str, dtype_name: str, tokens: int, g: torch.Generator) -> None:
        if self.out_of_time("silu_case"):
            return
        inter, dtype = MODELS[model]["inter"], DT[dtype_name]
        x = torch.randn((tokens, 2 * inter), device=DEV, dtype=dtype)
        out = torch.full((tokens, inter), float("nan"), device=DEV, dtype=dtype)
        silu_and_mul(x, out=out)
        err = rel_err(out, silu_and_mul_ref(x.double()))
        ms = median_ms(lambda: silu_and_mul(x, out=out))
        self.record("silu_and_mul", model, dtype_name, f"T={tokens} I={inter}", ms,
                    3 * tokens * inter * dtype.itemsize, err)

    # ---- sections --------------------------------------------------------------------------------------------
    def decode_all(self, g: torch.Generator, quick: bool) -> None:
        shapes = [(1, 32768), (64, 2048), (256, 512)] if quick else \
            [(1, 128), (1, 4096), (1, 32768), (16, 1024), (64, 2048), (256, 512), (256, 2048), (32, 8192)]
        for model in MODELS:
            for b, ctx in shapes:
                self.decode_case(model, "bf16", b, ctx, g)
            self.decode_case(model, "bf16", 64, torch.randint(1, 8192, (64,), generator=g).tolist(), g)
            for b, ctx in [(1, 32768), (64, 2048)]:
                self.decode_case(model, "fp32", b, ctx, g)

    def decode_tune(self, g: torch.Generator) -> None:
        tiles = [{"block_n": n, "num_warps": w} for n in (64, 128) for w in (4, 8)]
        self.decode_case("llama3.1-8b", "bf16", 1, 32768, g, variants=tiles)
        self.decode_case("qwen2.5-0.5b", "bf16", 256, 2048, g, variants=tiles)
        for model, b, ctx in [("llama3.1-8b", 1, 32768), ("llama3.1-8b", 16, 1024), ("qwen2.5-0.5b", 16, 4096),
                              ("qwen2.5-0.5b", 1, 32768)]:
            self.decode_case(model, "bf16", b, ctx, g, variants=[{"num_splits": s} for s in (1, 4, 16, 32, 64)])

    def prefill_tune(self, g: torch.Generator) -> None:
        tiles = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": st}
                 for m, n, w, st in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3),
                                     (128, 128, 8, 2), (64, 32, 4, 3)]]
        self.prefill_case("llama3.1-8b", "bf16", [8192], [0], g, "B=1 q=8192", variants=tiles)
        self.prefill_case("llama3.1-8b", "bf16", [512] * 4, [3584] * 4, g, "B=4 q=512 prefix=3584", variants=tiles)
        self.prefill_case("qwen2.5-0.5b", "bf16", [8192], [0], g, "B=1 q=8192", variants=tiles)

    def prefill_all(self, g: torch.Generator) -> None:
        for model in MODELS:
            self.prefill_case(model, "bf16", [2048], [0], g, "B=1 q=2048", sdpa=True)
            self.prefill_case(model, "bf16", [8192], [0], g, "B=1 q=8192", sdpa=True)
            self.prefill_case(model, "bf16", [512] * 4, [3584] * 4, g, "B=4 q=512 prefix=3584")
            ql = torch.randint(1, 512, (16,), generator=g).tolist()
            pf = torch.randint(0, 2048, (16,), generator=g).tolist()
            self.prefill_case(model, "bf16", ql, pf, g, "B=16 mixed q/prefix")
            self.prefill_case(model, "fp32", [512, 300], [512, 0], g, "B=2 q=512/300")

    def elementwise_all(self, g: torch.Generator) -> None:
        cases = (self.kv_write_case, self.rms_case, self.rotary_case, self.silu_case)
        for model in MODELS:
            for dt in ("bf16", "fp32"):
                for case in cases:
                    case(model, dt, 8192, g)
            for case in cases:
                case(model, "bf16", 256, g)

    def run_section(self, name: str, fn: Callable[[], None]) -> None:
        if self.out_of_time(name):
            return
        print(f"[{name}]", flush=True)
        try:
            fn()
        except Exception as exc:  # keep going: one broken section must not cost the whole lease
            traceback.print_exc()
            self.results.append({"kernel": name, "error": repr(exc)})
        torch.cuda.empty_cache()


def device_meta() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    meta = {"device": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None), "mem_bytes": props.total_memory,
            "capability": list(torch.cuda.get_device_capability(0)), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "timing": "triton.testing.do_bench median, L2 flushed before each repetition", "page_size": PAGE}
    print(f"device: {meta['device']} ({meta['sm_count']} SMs, L2 {meta['l2_bytes']}), torch {meta['torch']}, "
          f"triton {meta['triton']}, cuda {meta['cuda']}", flush=True)
    return meta


def print_table(meta: dict[str, Any], results: list[dict[str, Any]]) -> int:
    """The short table; 1 if any row is over tolerance or any section errored or was skipped."""
    rows = [r for r in results if "time_us" in r]
    fails = [r for r in rows if not r["ok"]]
    errors = [r for r in results if "error" in r or "skipped" in r]
    print(f"\n{meta['device']}: copy {meta['copy_gbps']:.0f} GB/s, bf16 mm {meta['matmul_tflops']:.0f} TFLOP/s; "
          f"{len(rows)} rows, {len(fails)} over tolerance, {len(errors)} sections errored/skipped, "
          f"{meta['wall_s']:.0f} s")
    print(f"{'kernel':<14}{'model':<13}{'dt':<5}{'shape':<34}{'us':>9}{'GB/s':>8}{'roof':>6}{'TF/s':>7}{'err':>9}"
          f"{'graph us':>10}{'roof':>6}")
    for r in rows:
        if r["kernel"] in ("decode_attn", "prefill_attn") and ("block_n" in r or "num_splits" in r):
            continue  # the tuning sweeps are in the JSON and the log above
        tf = f"{r['tflops']:7.0f}" if r["tflops"] else " " * 7
        print(f"{r['kernel'][:13]:<14}{r['model'][:12]:<13}{r['dtype']:<5}{r['shape'][:33]:<34}{r['time_us']:9.1f}"
              f"{r['gbps']:8.0f}{100 * r['roofline']:5.0f}%{tf}{r['rel_err']:9.1e}"
              + (f"{r['graph_us']:10.1f}{100 * r['graph_roofline']:5.0f}%" if r.get("graph_us") else "")
              + ("" if r["ok"] else " FAIL"))
    for r in errors:
        print("ERROR/SKIP:", r)
    return 1 if fails or errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="also write bench/results/gpu_kernels_<device>.json")
    ap.add_argument("--budget", type=float, default=230.0, help="seconds after which remaining sections are skipped")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and no tuning sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    meta = device_meta()
    bench = KernelBench(args.budget)
    bench.measure_ceilings()
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    bench.run_section("decode", lambda: bench.decode_all(g, args.quick))
    bench.run_section("decode_graph", lambda: bench.decode_graph_check(g))
    bench.run_section("prefill", lambda: bench.prefill_all(g))
    bench.run_section("elementwise", lambda: bench.elementwise_all(g))
    if not args.quick:
        bench.run_section("decode_tune", lambda: bench.decode_tune(g))
        bench.run_section("prefill_tune", lambda: bench.prefill_tune(g))
    meta.update(copy_gbps=bench.copy_gbps, matmul_tflops=bench.matmul_tflops, wall_s=time.time() - t0)
    text = json.dumps({"meta": meta, "results": bench.results}, indent=1, default=float)
    paths = [Path(os.environ["OUT"], "gpu_kernels.json")] if os.environ.get("OUT") else []
    paths += [RESULTS / f"gpu_kernels_{device_slug(meta['device'])}.json"] if args.record else []
    for path in paths:
        path.write_text(text)
        print(f"wrote {path}")
    return print_table(meta, bench.results)


if __name__ == "__main__":
    sys.exit(main())
