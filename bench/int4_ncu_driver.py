"""A process for Nsight Compute to profile (issue 32): the int4 kernels at one row on the Llama-8B gate|up and
o_proj weights (AWQ-shaped), each launched once, in this order: quant_mma_regs (tiles from argv, default
(4, 2, 8)), then the kn GEMV of quant_gemm_kn. Run it under ncu, e.g.

    ncu --clock-control none -k regex:"_regs_kernel|_kn_gemv_kernel" --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python3 -m bench.int4_ncu_driver 4 2 8
"""

from __future__ import annotations

import sys

import torch

from bench.quant_int4 import HIDDEN, INTER, arrivals_for, awq_weight, kn_out, regs_out
from engine.quant.kn_layout import to_kn


def main() -> None:
    tiles = tuple(int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (4, 2, 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [to_kn(awq_weight(n, k, "cuda", g)) for n, k in [(2 * INTER, HIDDEN), (HIDDEN, HIDDEN)]]
    arrivals = arrivals_for([weights])[0]
    x = torch.randn(1, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    for one, ov in [(regs_out, {"tiles": tiles}), (kn_out, {})]:
        for w, a in zip(weights, arrivals, strict=True):
            one(w, x, arrivals=a, **ov)
    torch.cuda.synchronize()
    print("ran", tiles, flush=True)


if __name__ == "__main__":
    main()
