"""CPU decode attention over the paged KV cache, compiled once from kernels/cpu/paged_decode_attention.cpp.

The torch path gathers every sequence's blocks into a padded copy and reads it again; this kernel reads each
block once. It is built on first use (or by `python -m kernels.cpu_decode_attention`) into the kvflow cache dir;
if no compiler is available the engine keeps the torch path. Reference: `paged_decode_attention_ref` in
kernels/paged_decode_attention.py.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from kernels.cpu_build import SOURCES, build_dir, build_locked, kernels_disabled, print_build_outcome

logger = logging.getLogger(__name__)


@functools.cache
def load_extension() -> Any | None:
    """The compiled module, or None (logged once) when it cannot be built here."""
    if kernels_disabled():
        return None
    try:
        return build_locked("kvflow_cpu_paged_attention", SOURCES / "paged_decode_attention.cpp", build_dir(),
                            ["-O3", "-march=native", "-fopenmp", "-ffast-math"])
    except Exception as exc:  # no compiler / headers: the torch path still works, only slower
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch path", exc)
        return None


def paged_decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU paged-attention kernel is not built")
    return extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


if __name__ == "__main__":
    print_build_outcome(load_extension)
