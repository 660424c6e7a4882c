"""Optional Triton import shared by the kernel modules.

The kernel modules must import on machines without Triton (CPU CI, the engine's
torch fallback), so every module takes ``triton``/``tl`` from here and guards its
``@triton.jit`` definitions with ``HAS_TRITON``. Launchers call ``require_triton``
so that using a kernel without Triton fails with a clear message instead of a
NameError.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

try:  # pragma: no cover - depends on the Triton version
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - depends on the Triton version
    gdc_launch_dependents = gdc_wait = None  # type: ignore[assignment]
    HAS_GDC = False

__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "require_triton",
    "next_pow2",
    "check_cache_layout",
    "dot_needs_upcast",
    "sm_count",
    "use_pdl",
    "pdl_launch",
    "pdl_wait",
]


def require_triton(name: str) -> None:
    """Raise a clear error when a Triton launcher is used without Triton installed."""
    if not HAS_TRITON:
        raise RuntimeError(
            f"kernels.{name} needs Triton, which is not installed; install the 'gpu' extra "
            "(pip install triton) or use the torch reference implementation"
        )


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1); Triton block shapes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def check_cache_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the paged KV cache contract and return (num_blocks, block_size, num_kv_heads, head_dim).

    Contract: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
    block_size a power of two (the kernels turn token index into page/offset with it).
    """
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            "key_cache/value_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} != value_cache {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache dtype {key_cache.dtype} != value_cache dtype {value_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return num_blocks, block_size, num_kv_heads, head_dim


def dot_needs_upcast(dtype: torch.dtype) -> bool:
    """True when ``tl.dot`` operands of this dtype must be upcast to fp32 first.

    Triton's CPU interpreter (TRITON_INTERPRET=1, checked in 3.9) keeps bf16 as raw uint16
    and multiplies the bit patterns in ``tl.dot``; compiled GPU code is unaffected and keeps
    its native bf16 products.
    """
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (tile heuristics size grids by it); 132 (an H100 / H200) for
    the CPU interpreter, where only the tiles' validity matters."""
    if device.type != "cuda":
        return 132
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def cuda_major(device: torch.device) -> int:
    """The compute capability's major version of a CUDA device (0 for others), cached per device: kernels choose
    by it on every call."""
    if device.type != "cuda":
        return 0
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device())


def use_pdl(device: torch.device) -> bool:
    """Launch with programmatic dependent launch (Hopper and later): the next kernel's programs are scheduled
    while this one drains and wait in `gdc_wait` until its writes are visible, hiding the ~1 us gap between the
    small kernels of a decode step. Kernels that take a `PDL` flag call `gdc_wait` before touching memory, so
    read-after-write and write-after-read order hold. KVFLOW_PDL=0 turns it off (A/B timing)."""
    if not HAS_GDC or device.type != "cuda" or os.environ.get("KVFLOW_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return cuda_major(device) >= 9


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel with a `PDL` flag: PDL=use_pdl(device), plus launch_pdl when on."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(device) else {"PDL": False}


if HAS_TRITON:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """A kernel's first step under programmatic dependent launch: wait for the previous kernel's writes (and
        its reads of what this one overwrites), then let the next kernel's programs be scheduled. Nothing this
        kernel reads or writes may be touched before it, except data no kernel of the step writes (weights)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

else:  # pragma: no cover - depends on the environment
    pdl_wait = None  # the kernel modules import it unconditionally and define their kernels only with Triton
