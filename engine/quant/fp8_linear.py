"""fp8 W8A8 linear layers (`--quantization fp8`, CUDA): e4m3 weights with one scale per output channel and
activations quantized per token at run time (dynamic scales), multiplied by `torch._scaled_mm` (cuBLASLt fp8 GEMM
on Hopper) with both scale vectors applied in its epilogue.

Weights come from a bf16/fp16 checkpoint quantized at load (online), or from a pre-quantized fp8 checkpoint
(`quantization_config.quant_method == "fp8"`: `*.weight` in float8_e4m3fn with `*.weight_scale`, per tensor or
per channel; activations always run dynamically per token, so a static `input_scale` is not needed).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.weight_map import checkpoint_keys, decoder_linear_paths, replace_module
from kernels.fp8_kv import FP8_DTYPE as FP8
from kernels.fp8_kv import FP8_MAX
from kernels.fp8_quant import INV_FP8_MAX, MIN_SCALE  # MIN_SCALE: an all-zero token still gets a finite scale


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], float32 scales [N]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (e4m3 [M, K], float32 scales [M, 1])."""
    xf = x.float()
    # amax times the float32 reciprocal of 448 (not a division): torch turns a CUDA tensor divided by a Python
    # scalar into exactly this product, on the CPU it divides; spelling it out keeps both, and the Triton kernel,
    # on the same bits.
    scale = (xf.abs().amax(dim=1, keepdim=True) * INV_FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The same product in plain float32: dequantized per-token activations @ dequantized weights."""
    xq, xs = quantize_per_token(x)
    return (xq.float() * xs) @ (weight.float() * weight_scale[:, None]).t()


def _quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token, in one Triton launch on CUDA (same codes and scales; kernels/fp8_quant.py)."""
    if x.is_cuda:
        from kernels._triton import HAS_TRITON

        if HAS_TRITON:
            from kernels.fp8_quant import per_token_quant_fp8

            return per_token_quant_fp8(x.contiguous())
    return quantize_per_token(x)


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype != FP8 or weight_scale.shape != (weight.shape[0],):
            raise ValueError(f"Fp8Linear needs an e4m3 weight [N, K] and per-channel scales [N], got "
                             f"{weight.dtype} {tuple(weight.shape)} / {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_dense(cls, linear: nn.Linear) -> Fp8Linear:
        q, scale = quantize_per_channel(linear.weight.detach())
        return cls(q, scale, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        xq, xs = _quantize_activations(flat)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.view(1, -1),
                               bias=None if self.bias is None else self.bias.to(x.dtype), out_dtype=x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 W8A8"


def quantize_model_fp8(model: nn.Module) -> None:
    """Swap every decoder linear of a loaded dense model for an Fp8Linear (embedding and head stay dense), one
    at a time so the dense weights are freed as it goes."""
    for path in decoder_linear_paths(model):
        replace_module(model, path, Fp8Linear.from_dense(model.get_submodule(path)))  # type: ignore[arg-type]
    for layer in model.layers:  # type: ignore[attr-defined]
        layer.small_gemm = False  # the fused single-row GEMVs read dense `.weight`s


def load_fp8_checkpoint(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A pre-quantized fp8 checkpoint: dense tensors load as usual (the fp8 linears dequantized transiently to
    satisfy the loader), then each fused linear is rebuilt from the stored e4m3 weights and their scales."""
    dense = dict(state)
    scales = {k[: -len("_scale")]: v for k, v in state.items() if k.endswith(".weight_scale")}
    for name, scale in scales.items():
        w = state[name]
        dense[name] = w.float() * _per_channel(scale, w.shape[0])[:, None]
        dense.pop(name + "_scale")
    for k in [k for k in dense if k.endswith(".input_scale")]:  # activations are quantized per token instead
        dense.pop(k)
    model.load_hf_state_dict(dense)  # type: ignore[operator]
    for path in decoder_linear_paths(model):
        keys = checkpoint_keys(type(model), f"{path}.weight")  # type: ignore[arg-type]
        if not all(k in scales for k in keys):
            raise ValueError(f"fp8 checkpoint: {', '.join(k for k in keys if k not in scales)} lack a "
                             "weight_scale (every decoder linear must be fp8)")
        old = model.get_submodule(path)
        device = old.weight.device
        weight = torch.cat([state[k] for k in keys]).to(device)
        scale = torch.cat([_per_channel(scales[k], state[k].shape[0]) for k in keys]).to(device)
        replace_module(model, path, Fp8Linear(weight, scale, None if old.bias is None else old.bias.detach()))
    for layer in model.layers:  # type: ignore[attr-defined]
        layer.small_gemm = False


def _per_channel(scale: torch.Tensor, rows: int) -> torch.Tensor:
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        return flat.expand(rows).clone()
    if flat.numel() != rows:
        raise ValueError(f"fp8 checkpoint: weight_scale of {flat.numel()} values for {rows} output channels")
    return flat
