"""CPU kernels for group-quantized linears, compiled once from kernels/cpu/quant_gemm.cpp (like the CPU
decode-attention kernel; kernels/cpu_build.py). Reference: `engine.quant.group_quant.dequantize` /
`quant_matmul_ref`."""

from __future__ import annotations

from kernels.cpu_build import QUANT_GEMM, kernel_loader, print_build_outcome

# The compiled module, or None (logged once) when it cannot be built here: the torch path runs then.
load_quant_extension = kernel_loader(QUANT_GEMM)

if __name__ == "__main__":
    print_build_outcome(load_quant_extension)
