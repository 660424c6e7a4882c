"""Group-wise weight-only quantized layers: `QuantLinear` and `QuantEmbedding` hold a weight of
engine/quant/group_quant.py's canonical layout (or, for 4-bit weights on CUDA, engine/quant/kn_layout.py's) and run
it by the fastest path for the device and batch: the compiled CPU kernel, the Triton kernels, or the torch
reference. Above both layouts, so neither imports the other's users.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.group_quant import KINDS, QuantWeight, dequantize, quant_matmul_ref, tile_rows
from engine.quant.kn_layout import KNWeight, from_kn, kernel_offsets, to_kn

# Up to this many input rows the CPU kernel computes dot products straight from the packed weights; above it,
# dequantized tiles feed a matmul (the dequantization is then shared by many rows).
KERNEL_MAX_ROWS = 8


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W kept quantized. CPU fp32: the compiled kernel (kernels/cpu_quant_gemm.py) for small
    batches and its dequantized tiles for larger ones; CUDA: the Triton dequant GEMM/GEMV (kernels/quant_gemm.py),
    and for 4-bit weights the kn layout (engine/quant/kn_layout.py) with its own kernels
    (kernels/quant_gemm_kn.py); elsewhere (or without a compiler / Triton) the torch reference.

    `layout`: "auto" picks kn for 4-bit weights on CUDA, else the canonical layout; "kn" on CPU is for tests of
    the Triton kernels under the interpreter."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None,
                 layout: Literal["auto", "canonical", "kn"] = "auto") -> None:
        super().__init__()
        self.bits, self.kind, self.group_size = weight.bits, weight.kind, weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        if layout == "auto":
            layout = "kn" if weight.bits == 4 and weight.qweight.is_cuda else "canonical"
        if layout not in ("canonical", "kn"):
            raise ValueError(f"unknown quantized weight layout {layout!r}; choose 'auto', 'canonical' or 'kn'")
        self.layout = layout
        stored: QuantWeight | KNWeight = weight
        if layout == "kn":
            stored = to_kn(weight)
        self.register_buffer("qweight", stored.qweight)
        self.register_buffer("scales", stored.scales)
        self.register_buffer("mins", stored.mins)
        self.register_buffer("zeros", stored.zeros)
        # kn one-row calls count the K split's arrivals per column tile here and sum in the same launch
        arrivals = None
        if layout == "kn":
            from kernels.quant_gemm_kn import new_arrivals

            arrivals = new_arrivals(self.out_features, weight.qweight.device)
        self.register_buffer("arrivals", arrivals, persistent=False)
        # kn on the CPU runs the Triton kernels only under the interpreter (tests); read once, not per call
        self._kn_kernel_on_cpu = os.environ.get("TRITON_INTERPRET") == "1"
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.use_kernel = True  # tests turn it off to run the torch reference

    def quant_weight(self) -> QuantWeight:
        """The weight in the canonical layout (rebuilt from the kn layout when that is what is held)."""
        if self.layout == "kn":
            return from_kn(self._kn_weight())
        return QuantWeight(self.bits, self.kind, self.group_size, self.out_features, self.in_features,  # type: ignore[arg-type]
                           self.qweight, self.scales, self.mins, self.zeros)

    def _kn_weight(self) -> KNWeight:
        return KNWeight(self.kind, self.group_size, self.out_features, self.in_features,  # type: ignore[arg-type]
                        self.qweight, self.scales, self.mins, self.zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.layout == "kn" and self.use_kernel and (flat.is_cuda or self._kn_kernel_on_cpu):
            from kernels.quant_gemm_kn import quant_gemm_kn

            # the buffers as they are (no KNWeight per call: its shape checks ran once, at init)
            offsets = kernel_offsets(self.scales, self.mins, self.zeros)
            out = quant_gemm_kn(flat.contiguous(), self.qweight, self.scales, offsets, KINDS.index(self.kind),
                                self.group_size, self.out_features, arrivals=self.arrivals)
        else:
            out = quant_matmul(flat, self.quant_weight(), self.use_kernel)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"kind={self.kind}, group_size={self.group_size}, layout={self.layout}")


def quant_matmul(x: torch.Tensor, w: QuantWeight, use_kernel: bool = True) -> torch.Tensor:
    """x [M, K] @ W^T by the fastest available path for this device and batch."""
    if use_kernel and x.device.type == "cpu" and x.dtype == torch.float32:
        from kernels.cpu_quant_gemm import load_quant_extension

        ext = load_quant_extension()
        if ext is not None:
            x = x.contiguous()
            if x.shape[0] <= KERNEL_MAX_ROWS:
                return ext.quant_gemv(x, w.qweight, w.scales, _offsets(w), w.bits, KINDS.index(w.kind),
                                      w.group_size)
            out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
            tile = tile_rows(w)
            for start in range(0, w.out_features, tile):
                end = min(start + tile, w.out_features)
                deq = ext.dequantize(w.qweight[start:end], w.scales[start:end], _offsets(w, start, end), w.bits,
                                     KINDS.index(w.kind), w.group_size)
                out[:, start:end] = x @ deq.t()
            return out
    if use_kernel and x.is_cuda:
        from kernels._triton import HAS_TRITON

        if HAS_TRITON:
            from kernels.quant_gemm import quant_gemm

            return quant_gemm(x.contiguous(), w.qweight, w.scales, _offsets(w), w.bits, KINDS.index(w.kind),
                              w.group_size, w.out_features)
    return F.linear(x, dequantize(w).to(x.dtype)) if w.out_features <= tile_rows(w) else quant_matmul_ref(x, w)


def _offsets(w: QuantWeight, start: int = 0, end: int | None = None) -> torch.Tensor:
    end = w.out_features if end is None else end
    if w.mins is not None:
        return w.mins[start:end]
    if w.zeros is not None:
        return w.zeros[start:end]
    return torch.empty(0, dtype=torch.uint8)


class QuantEmbedding(nn.Module):
    """Token embedding kept quantized: looked-up rows are dequantized on the fly. It also serves as the tied
    logits head (`logits`)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.linear = QuantLinear(weight, layout="canonical")  # looked-up rows are dequantized from it
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        # Follows module-wide casts (model.to(dtype)): the dtype the looked-up rows are returned in.
        self.register_buffer("dtype_ref", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.linear.quant_weight()
        flat = ids.reshape(-1)
        return dequantize(w.rows(flat)).to(self.dtype_ref.dtype).view(*ids.shape, self.embedding_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden)


def module_weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and persistent-looking buffers (weights), counting shared storage once;
    rotary cos/sin tables (derived, not weights) are excluded. A oneDNN-packed CPU linear (engine/runner/cpu_linear.py)
    holds its weight only packed, an opaque tensor outside the parameters: counted by its elements."""
    seen: set[int] = set()
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rotary.") or t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor) and packed.layout == torch._mkldnn:
            total += packed.numel() * packed.element_size()
    return total
