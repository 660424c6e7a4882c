"""CPU kernels for group-quantized linears, compiled once from kernels/cpu/quant_gemm.cpp (like the CPU
decode-attention kernel). Reference: `engine.quant.group_quant.dequantize` / `quant_matmul_ref`."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from kernels.cpu_decode_attention import load_exact_extension

SOURCE = Path(__file__).parent / "cpu" / "quant_gemm.cpp"


@functools.cache
def load_quant_extension() -> Any | None:
    """The compiled module, or None (logged once) when it cannot be built here: the torch path runs then."""
    return load_exact_extension("kvflow_cpu_quant_gemm", SOURCE, "quantized-GEMM")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("built" if load_quant_extension() is not None else "not built")
