"""A process for Nsight Compute to profile (issue 32): one int4 kernel over the Llama-8B gate|up and o_proj weights
(AWQ-shaped), each launched once, at a chosen row count:
- `regs` (kernels/quant_mma_regs.py; tiles: warps, column tiles per warp, programs per SM; default 4 2 8), then the
  kn GEMV of quant_gemm_kn (one row only);
- `wgmma` (kernels/quant_wgmma.py; tiles: warpgroups, column tiles, rows per program, programs per SM);
- `smem` (kernels/quant_wgmma_smem.py; tiles: columns, warps, x stages, programs per SM, rows per program);
- `bf16`: the dense product of the same shapes (cuBLAS), for the same counters.
Run it under ncu, e.g.

    ncu --clock-control none -k regex:"_regs_kernel|_kn_gemv_kernel" --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python3 -m bench.int4_ncu_driver regs --tiles 4 2 8
        (before 2026-12-07 the tiles were positional: `python3 -m bench.int4_ncu_driver 4 2 8`)
    ncu --clock-control none -k regex:"_smem_kernel|nvjet" --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        python3 -m bench.int4_ncu_driver smem --rows 256 --tiles 128 8 3 2 128
"""

from __future__ import annotations

import argparse

import torch

from bench.quant_int4 import HIDDEN, INTER, arrivals_for, awq_weight, kn_out, regs_out, smem_out, wgmma_out
from engine.quant.kn_layout import to_kn

KERNELS = {"regs": regs_out, "wgmma": wgmma_out, "smem": smem_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", nargs="?", default="regs", choices=[*KERNELS, "bf16"])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tiles", type=int, nargs="+", default=None, help="the kernel's tiles (its own order)")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2 * INTER, HIDDEN), (HIDDEN, HIDDEN)]
    x = torch.randn(args.rows, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    if args.kernel == "bf16":
        for n, k in shapes:
            x @ torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16).t()
    else:
        weights = [to_kn(awq_weight(n, k, "cuda", g)) for n, k in shapes]
        arrivals = arrivals_for([weights])[0]
        tiles = tuple(args.tiles) if args.tiles else ((4, 2, 8) if args.kernel == "regs" else None)
        runs = [(KERNELS[args.kernel], {"tiles": tiles} if tiles else {})]
        runs += [(kn_out, {})] if args.kernel == "regs" and args.rows == 1 else []
        for one, ov in runs:
            for w, a in zip(weights, arrivals, strict=True):
                one(w, x, arrivals=a, **ov)
    torch.cuda.synchronize()
    print("ran", args.kernel, args.rows, args.tiles, flush=True)


if __name__ == "__main__":
    main()
