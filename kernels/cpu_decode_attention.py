"""CPU decode attention over the paged KV cache, compiled once from kernels/cpu/paged_decode_attention.cpp.

The torch path gathers every sequence's blocks into a padded copy and reads it again; this kernel reads each
block once. It is built on first use (or by `python -m kernels.cpu_decode_attention`) into the kvflow cache dir;
if no compiler is available the engine keeps the torch path. Reference: `paged_decode_attention_ref` in
kernels/paged_decode_attention.py.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import DECODE_ATTENTION, kernel_loader, print_build_outcome

# The compiled module, or None (logged once) when it cannot be built here: the torch path runs then.
load_extension = kernel_loader(DECODE_ATTENTION)


def paged_decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU paged-attention kernel is not built")
    return extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


if __name__ == "__main__":
    print_build_outcome(load_extension)
