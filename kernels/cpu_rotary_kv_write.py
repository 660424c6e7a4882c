"""Rotary embedding + KV-cache write for the CPU fp32 path, compiled once from kernels/cpu/rotary_kv_write.cpp
(like the CPU decode-attention kernel; kernels/cpu_build.py). Bit-identical to the torch ops it replaces
(`RotaryEmbedding.rotate`, then `index_copy_` of k and v into the cache): tests/kernels/test_cpu_kernel.py
checks it with `torch.equal`."""

from __future__ import annotations

from kernels.cpu_build import ROTARY_KV_WRITE, kernel_loader, print_build_outcome

# The compiled module, or None (logged once) when it cannot be built here: the torch path runs then.
load_rotary_extension = kernel_loader(ROTARY_KV_WRITE)

if __name__ == "__main__":
    print_build_outcome(load_rotary_extension)
