"""CPU kernels for group-quantized linears, compiled once from kernels/cpu/quant_gemm.cpp (like the CPU
decode-attention kernel). Reference: `engine.quant.group_quant.dequantize` / `quant_matmul_ref`."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from kernels.cpu_decode_attention import DISABLE_ENV, _build_dir

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "quant_gemm.cpp"


@functools.cache
def load_quant_extension() -> Any | None:
    """The compiled module, or None (logged once) when it cannot be built here: the torch path runs then."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # No -ffast-math: the dequantization must equal the reference bit for bit (no fused multiply-adds).
        build = _build_dir() / "quant_gemm"  # its own directory: one build.ninja per extension
        build.mkdir(exist_ok=True)
        return load(name="kvflow_cpu_quant_gemm", sources=[str(SOURCE)], build_directory=str(build),
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler / headers
        logger.warning("CPU quantized-GEMM kernel unavailable (%s); using the torch path", exc)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("built" if load_quant_extension() is not None else "not built")
