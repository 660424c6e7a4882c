"""The building blocks every decoder model here shares: RMS norm (with vLLM's fused residual add), the Neox-style
rotary embedding (every rope type, as transformers computes it), how single-token steps run their linears on the
Triton path (`SmallGemmMode`), and what a tensor-parallel model needs from its process group (`Collectives`).

With `fused` (the CUDA path) the norms and rotary run as the Triton kernels in kernels/; without it (CPU) they are
the plain torch ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import rotary_embedding
from kernels.small_gemm import GemvConfig, small_gemm


class Collectives(Protocol):
    """What a tensor-parallel model needs from its process group (engine/parallel/group.py)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last_dim(self, tensor: torch.Tensor, width: int) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same arithmetic as below (products commute bit for bit), without the no-op casts and with two
            # of the four temporaries reused in place: fewer ops per layer on small decode batches.
            variance = x.pow(2).mean(-1, keepdim=True)
            return (x * variance.add_(self.eps).rsqrt_()).mul_(self.weight)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual yet, x starts it. Fused: in place on both."""
        if residual is None:
            return self(x), x
        if self.fused:
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual


@dataclass(frozen=True)
class SmallGemmMode:
    """How single-token steps run their linear layers on the Triton path (kernels/small_gemm.py), as measured on
    an H100 (bench/GPU_NOTES.md): CUDA-core GEMVs beat cuBLAS's split-K pair; SwiGLU folds into the down
    projection for free; the residual-add + RMSNorm folds in only for narrow hidden sizes (its extra pass over
    the hidden vector, repeated by every program, costs more than the separate norm kernel at 4096).
    Read once at model build; KVFLOW_SMALL_GEMM = auto | plain (no prologues) | fused (all prologues) | 0 (cuBLAS),
    KVFLOW_SMALL_GEMM_IMPL = gemv | dot and KVFLOW_GEMV (the GEMV's streaming flags, `GemvConfig.parse`) exist for
    A/B timing in bench/gpu_bench.py (retired: it runs at `git checkout efcd5a5`)."""

    enabled: bool = True
    norm_max_hidden: int = 2048  # fuse the norm into the GEMM when hidden_size <= this
    fuse_silu: bool = True
    impl: str = "gemv"
    gemv: GemvConfig = GemvConfig()  # the GEMV's tiles (per shape) and load streaming

    @staticmethod
    def from_env() -> SmallGemmMode:
        mode = os.environ.get("KVFLOW_SMALL_GEMM", "auto")
        impl = os.environ.get("KVFLOW_SMALL_GEMM_IMPL", "gemv")
        if mode not in ("auto", "plain", "fused", "0") or impl not in ("gemv", "dot"):
            raise ValueError(f"KVFLOW_SMALL_GEMM must be auto, plain, fused or 0 and KVFLOW_SMALL_GEMM_IMPL gemv or "
                             f"dot, got {mode!r} and {impl!r}")
        norm_max = {"auto": 2048, "plain": 0, "fused": 1 << 30, "0": 0}[mode]
        gemv = GemvConfig.parse(os.environ["KVFLOW_GEMV"]) if "KVFLOW_GEMV" in os.environ else GemvConfig()
        return SmallGemmMode(enabled=mode != "0", norm_max_hidden=norm_max, fuse_silu=mode != "plain", impl=impl,
                             gemv=gemv)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`small_gemm` with this mode's kernel and GEMV config."""
        return small_gemm(x, weight, impl=self.impl, gemv=self.gemv, **kwargs)


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them (all rope types)."""
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
            return inv_freq.float(), float(scaling)
    except ImportError:
        pass
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin cache."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, fused: bool = False) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        half = head_dim // 2
        self.register_buffer("cos_half", self.cos[:, :half].contiguous(), persistent=False)
        self.register_buffer("sin_half", self.sin[:, :half].contiguous(), persistent=False)
        self.fused = fused
        if fused:  # the kernel's layout (vLLM's): [max_pos, D] = cos of each frequency, then sin
            half = head_dim // 2
            self.register_buffer("cos_sin", torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=-1),
                                 persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            rotary_embedding(positions, q, k, self.cos_sin)  # in place, fp32 math
            return q, k
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] -> a new rotated tensor. Per half, exactly HF's `x * cos + rotate_half(x) * sin`
        (cos/sin repeat across halves), with fewer full-size temporaries."""
        half = x.shape[-1] // 2
        cos = self.cos_half[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D/2]
        sin = self.sin_half[positions].unsqueeze(1).to(x.dtype)
        first, second = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.sub(first * cos, second * sin, out=out[..., :half])
        torch.add(second * cos, first * sin, out=out[..., half:])
        return out
