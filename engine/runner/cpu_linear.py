"""oneDNN-packed linear layers for the CPU fp32 path.

On the project's CPUs (AMD EPYC with AVX-512) PyTorch's default BLAS path for fp32 `F.linear` runs 1.4-2.3x slower
than oneDNN with the weight reordered once into its blocked layout (measured A/B in one process, decode and prefill
shapes of SmolLM2). oneDNN's results also do not depend on how many rows share the call, so a sequence computes the
same logits alone or in a batch. Weights are packed once after loading, and a packed linear drops its plain weight
(keeping both held every linear twice: SmolLM2 fp32, ~430 MB more per CPU worker); its `weight` unpacks a copy on
demand. The logits head keeps its plain weight when it is the tied embedding (the embedding lookup reads it).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight, unpacked on demand (exact): a copy for introspection and weight copies, never the
        forward path; writing to it does not change the layer."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_matmul(x, self.packed, self.bias)


class PackedHead:
    """Logits projection with a packed copy of the (possibly tied) output embedding."""

    def __init__(self, weight: torch.Tensor, batch_hint: int) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return _packed_matmul(hidden, self.packed, None)


def pack_linears_for_cpu(model: nn.Module, batch_hint: int) -> bool:
    """Swap every nn.Linear of an fp32 CPU model for a packed one and give it a packed logits head."""
    if not onednn_available():
        logger.info("oneDNN is unavailable: CPU linears use the default BLAS path")
        return False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and not child.weight.is_meta:
                setattr(parent, name, PackedLinear(child, batch_hint))
    if getattr(model, "cpu_logits_head", None) is not None:  # a quantized head (engine/quant) keeps its own
        return True
    # the model names its own logits module (lm_head, or the tied embedding): no architecture's names here; an
    # lm_head packed above is its own logits head (its plain weight is gone)
    head = model.head_module()  # type: ignore[operator]
    if head.weight.is_meta:  # a pipeline stage before the last computes no logits
        return True
    model.cpu_logits_head = head if isinstance(head, PackedLinear) else PackedHead(head.weight, batch_hint)
    return True
