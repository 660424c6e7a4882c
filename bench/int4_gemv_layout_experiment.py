"""Experiment (issue 14, int4 batch-1 decode): does a GPU-side transposed 4-bit packing make the Triton GEMV faster?

The shipped GEMV (kernels/quant_gemm.py) reads the canonical layout ([N, K/2] bytes, GGUF nibble order, K
contiguous) at ~1.16 TB/s on an H100. A rewrite over that layout with cheaper dequantization did not help
(bench/results/quant_q4gemv_h100.json: per code one scalar x load, and a shared-memory layout change per
iteration). Here the codes are packed [K/8, N] as int32 words (N contiguous, code 8 k8 + j at bits 4 j; float16
scales and mins [K/G, N]), so each thread owns a few whole columns: x is a warp-uniform broadcast reused across
them, and scales load in the accumulator's own layout. Dequantization as in that rewrite: nibble -> 1 + q / 16
by OR-ing into 1.0's bits (one PTX lop3 with `asm`), the group affine applied once per 32-element sub-block.

Llama-3.1-8B decode step at batch 1 (32 layers x qkv / o / gate_up / down, distinct weights, Q4_1-style group 32,
one CUDA graph) against bf16 (cuBLAS) in the same run; the layout is built here from random codes (not wired into
the engine). Writes $OUT/int4_gemv_layout.json (or /tmp).

    python3 bench/int4_gemv_layout_experiment.py                      # a CUDA GPU
    TRITON_INTERPRET=1 python3 bench/int4_gemv_layout_experiment.py   # correctness at tiny shapes, CPU
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.quant.kn_layout import pack_kn  # noqa: E402  (the layout this prototype led to)
from kernels.quant_gemm_kn import _sum_splits_kernel, _unit  # noqa: E402  (the kernel module's own helpers)


@triton.jit
def _q4t_kernel(X, QT, S, M, Y, N, K, K_PER_SPLIT, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr,
                ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    sub = tl.arange(0, NSUB)
    word = tl.arange(0, 4)
    # [NSUB, 4, BLOCK_N]: word row (k/8) 4 sub + word of the iteration, column n
    w_rows = (4 * sub)[:, None] + word[None, :]
    q_ptrs = QT + w_rows[:, :, None].to(tl.int64) * N + offs_n[None, None, :]
    x_ptrs = X + (32 * sub)[:, None] + (8 * word)[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, 32 * NSUB):
        w = tl.load(q_ptrs + (k0 // 8) * N, mask=n_mask[None, None, :], other=0,
                    eviction_policy="evict_first")
        s_vx = tl.zeros([NSUB, 4, BLOCK_N], dtype=tl.float32)
        s_x = tl.zeros([NSUB, 4], dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_ptrs + k0 + j).to(tl.float32)
            s_vx += _unit(w, 4 * j, ASM) * xj[:, :, None]
            s_x += xj
        grp = (k0 + 32 * sub) // GROUP
        m_ptrs = grp[:, None].to(tl.int64) * N + offs_n[None, :]
        d = tl.load(S + m_ptrs, mask=n_mask[None, :], other=0).to(tl.float32)
        c = tl.load(M + m_ptrs, mask=n_mask[None, :], other=0).to(tl.float32)
        acc += tl.sum((16.0 * d) * tl.sum(s_vx, axis=1) + (c - 16.0 * d) * tl.sum(s_x, axis=1)[:, None], axis=0)
    tl.store(Y + pid_s.to(tl.int64) * N + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


def q4t_gemv(x, qt, s, m, group, n, tiles=(256, 2, 8, 4), asm=True, sms=132):
    k = x.shape[1]
    block_n, nsub, per_sm, warps = tiles
    while (k // 32) % nsub:
        nsub //= 2
    iters = k // (32 * nsub)
    split = max(1, min(iters, (per_sm * sms) // -(-n // block_n)))
    per_split = -(-iters // split) * 32 * nsub
    split = -(-k // per_split)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = y if split == 1 else torch.empty(split, n, dtype=torch.float32, device=x.device)
    _q4t_kernel[(triton.cdiv(n, block_n), split)](x, qt, s, m, part, n, k, per_split, GROUP=group, BLOCK_N=block_n,
                                                 NSUB=nsub, ASM=asm, num_warps=warps)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(n, 1024),)](part, y, n, SPLIT=split, BLOCK=1024, PDL=False)
    return y


def make(n, k, group, dev, g):
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8, device=dev)
    s = (torch.rand(k // group, n, generator=g, device=dev) * 0.002).half()
    m = (-torch.rand(k // group, n, generator=g, device=dev) * 0.01).half()
    return q, pack_kn(q), s, m


def ref(x, q, s, m, group):
    n, k = q.shape
    w = q.float() * s.float().t().repeat_interleave(group, 1) + m.float().t().repeat_interleave(group, 1)
    return x.float() @ w.t()


# (BLOCK_N columns, NSUB sub-blocks per iteration, programs per SM when K splits, warps) x PTX lop3. H100 rounds:
# 1: 128 columns on one warp won (2.92 ms vs bf16 5.19); 2: 64 columns, 4 sub-blocks, 16 per SM (2.68 ms);
# 3 (these): around it, and the two round-1 references.
CONFIGS = [((128, 2, 8, 1), False), ((128, 2, 8, 1), True)] + [
    ((bn, nsub, per_sm, warps), True)
    for bn, nsub, per_sm, warps in ((64, 4, 16, 1), (32, 4, 16, 1), (32, 4, 32, 1), (64, 2, 16, 1), (64, 4, 12, 1),
                                    (64, 4, 24, 1), (32, 8, 32, 1), (64, 4, 16, 2), (32, 2, 32, 1), (64, 2, 24, 1))
]


def main() -> None:
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cpu" if interp else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    if interp:
        for n, k, group, tiles in [(40, 256, 32, (16, 2, 8, 1)), (40, 512, 128, (32, 4, 1, 1))]:
            q, qt, s, m = make(n, k, group, dev, g)
            x = torch.randn(1, k, generator=g, device=dev)
            y = q4t_gemv(x, qt, s, m, group, n, tiles, asm=False)
            r = ref(x, q, s, m, group)
            print(n, k, group, float((y - r).norm() / r.norm()))
        return
    from bench.gpu_gemv import graph_seconds
    hidden, inter, n_layers = 4096, 14336, 32  # Llama-3.1-8B
    shapes = [(hidden + 2 * 1024, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    layers = [[make(n, k, 32, dev, g)[1:] for n, k in shapes] for _ in range(n_layers)]
    nbytes = sum(t.numel() * t.element_size() for ws in layers for w in ws for t in w)
    bf16 = [[torch.randn(n, k, generator=g, device=dev, dtype=torch.bfloat16) for n, k in shapes] for _ in range(n_layers)]
    xs = {k: torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16) for k in (hidden, inter)}
    bf_ms = graph_seconds(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for ws in bf16 for w in ws], 10) * 1e3
    out = {"bf16_step_ms": bf_ms, "int4_bytes": nbytes, "configs": []}
    print("bf16", bf_ms, flush=True)
    # correctness at the real down shape
    q, qt, s, m = make(hidden, inter, 32, dev, g)
    r = ref(xs[inter], q, s, m, 32)
    del q
    for tiles, asm in CONFIGS:
        rec = {"tiles": tiles, "asm": asm}
        try:
            y = q4t_gemv(xs[inter], qt, s, m, 32, hidden, tiles, asm)
            rec["rel_err"] = float((y.float() - r).norm() / r.norm())
            fn = functools.partial(lambda t, a: [q4t_gemv(xs[k], *w, 32, n, t, a) for ws in layers
                                                 for (n, k), w in zip(shapes, ws, strict=True)], tiles, asm)
            ms = graph_seconds(fn, 10) * 1e3
            rec.update(step_ms=ms, vs_bf16=bf_ms / ms, tb_s=nbytes / ms / 1e9)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(rec, flush=True)
        out["configs"].append(rec)
    best = min((c for c in out["configs"] if "step_ms" in c), key=lambda c: c["step_ms"])
    out["best"] = best
    # the biggest weight alone (gate_up, 58 MB): the loop's own streaming rate, launch gaps aside
    n, k = shapes[2]
    w = layers[0][2]
    one = graph_seconds(lambda: q4t_gemv(xs[k], *w, 32, n, best["tiles"], best["asm"]), 20)
    out["gate_up_alone_tb_s"] = sum(t.numel() * t.element_size() for t in w) / one / 1e12
    buf = torch.empty(sum(t.numel() * t.element_size() for t in w) // 2, dtype=torch.bfloat16, device=dev)
    out["stream_read_same_bytes_tb_s"] = buf.numel() * 2 / graph_seconds(lambda: buf.sum(dtype=torch.float32)) / 1e12
    print({k: v for k, v in out.items() if k != "configs"}, flush=True)
    Path(os.environ.get("OUT", "/tmp"), "int4_gemv_layout.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
