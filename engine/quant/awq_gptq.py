"""AWQ and GPTQ 4-bit checkpoints (`quantization_config.quant_method` awq / gptq), unpacked at load into the
canonical group layout of engine/quant/group_quant.py (kind "zero": w = (q - z) * s) and run by the same int4
kernels as GGUF.

Layouts (HF checkpoints; `in` = K input features, `out` = N output features, G = group_size):
- AWQ ("gemm" version): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], eight 4-bit values per int32 along
  N in AutoAWQ's order: nibble i of packed column c holds column 8c + AWQ_ORDER[i]; `scales` fp16 [K/G, N].
- GPTQ: `qweight` int32 [K/8, N], nibble i of packed row r holding row 8r + i; `qzeros` int32 [K/G, N/8]
  (sequential nibbles along N, stored as zero - 1: the original GPTQ format); `scales` fp16 [K/G, N]; `g_idx`
  int32 [K] must be k // G (act-order checkpoints, desc_act=True, are refused).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.weight_map import checkpoint_modules, decoder_linear_paths, replace_module
from engine.quant.group_quant import QuantWeight, dequantize, fp16_bits, pack_int4
from engine.quant.quant_layers import QuantLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def check_config(method: str, qc: dict[str, Any]) -> None:
    """Refuse, with the reason, layouts the int4 kernels cannot run."""
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with bits={bits}: kvflow runs 4-bit {method} only")
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise ValueError(f"{method} checkpoint with group_size={group}: kvflow needs a positive multiple of 32")
    if method == "gptq" and qc.get("desc_act"):
        raise ValueError("gptq checkpoint with desc_act=True (act-order): its groups are permuted along the input "
                         "dim (g_idx), which kvflow's group layout does not run; re-quantize with desc_act=False")
    if method == "awq":
        if qc.get("zero_point") is False:
            raise ValueError("awq checkpoint with zero_point=False is not supported")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq checkpoint version {version!r}: kvflow reads the 'gemm' packing only")


def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C], nibble i of column c going to column 8c + order[i] (sequential if None)."""
    nib = (packed.unsqueeze(-1) >> SHIFTS.to(packed.device)) & 0xF  # [R, C, 8]: nibble i
    if order is not None:
        out = torch.empty_like(nib)
        out[..., list(order)] = nib
        nib = out
    return nib.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> QuantWeight:
    q = _unpack_cols(qweight, AWQ_ORDER)  # [K, N]
    z = _unpack_cols(qzeros, AWQ_ORDER)  # [K/G, N]
    k, n = q.shape
    return QuantWeight(4, "zero", group, n, k, pack_int4(q.t().contiguous()), fp16_bits(scales.t()),
                       zeros=z.t().contiguous())


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group: int, name: str) -> QuantWeight:
    kp, n = qweight.shape
    q = ((qweight.unsqueeze(1) >> SHIFTS.to(qweight.device)[None, :, None]) & 0xF).reshape(kp * 8, n).to(torch.uint8)
    k = kp * 8  # q: [K, N]
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // group):
        raise ValueError(f"{name}: g_idx is not k // group_size (an act-order layout); kvflow cannot run it")
    z = ((_unpack_cols(qzeros, None) + 1) & 0xF).to(torch.uint8)  # stored as (zero - 1) mod 16
    return QuantWeight(4, "zero", group, n, k, pack_int4(q.t().contiguous()), fp16_bits(scales.t()),
                       zeros=z.t().contiguous())


def unpack_state(state: dict[str, torch.Tensor], method: str, group: int,
                 device: torch.device | None = None) -> dict[str, QuantWeight]:
    """Every `<base>.qweight` of a checkpoint state (with its qzeros / scales / g_idx) as a QuantWeight by base,
    unpacked on `device` (default: where the state is; a GPU unpacks an 8B model in a blink, a CPU in minutes)."""
    quant: dict[str, QuantWeight] = {}
    for key in [k for k in state if k.endswith(".qweight")]:
        base = key[: -len(".qweight")]
        for part in ("qzeros", "scales"):
            if f"{base}.{part}" not in state:
                raise ValueError(f"{method} checkpoint: {base}.{part} is missing")
        qweight, qzeros, scales = (state[f"{base}.{part}"].to(device) for part in ("qweight", "qzeros", "scales"))
        if method == "awq":
            quant[base] = unpack_awq(qweight, qzeros, scales, group)
        else:
            g_idx = state.get(f"{base}.g_idx")
            quant[base] = unpack_gptq(qweight, qzeros, scales, None if g_idx is None else g_idx.to(device), group,
                                      base)
    return quant


def install_quant_linears(model: nn.Module, quant: dict[str, QuantWeight], method: str) -> None:
    """Replace each decoder linear by a QuantLinear of its checkpoint modules' weights, stacked as the model
    class declares them (q|k|v, gate|up); the dense bias, if any, is kept."""
    for path in decoder_linear_paths(model):
        bases = checkpoint_modules(type(model), path)  # type: ignore[arg-type]
        missing = [b for b in bases if b not in quant]
        if missing:
            raise ValueError(f"{method} checkpoint: {', '.join(missing)} not quantized (no qweight)")
        old = model.get_submodule(path)
        w = QuantWeight.cat([quant[b] for b in bases]).to(old.weight.device)
        bias = None if old.bias is None else old.bias.detach()
        replace_module(model, path, QuantLinear(w, bias))
    for layer in model.layers:  # type: ignore[attr-defined]
        layer.small_gemm = False  # the fused single-row GEMVs read dense `.weight`s


def load_awq_gptq(model: nn.Module, state: dict[str, torch.Tensor], method: str, qc: dict[str, Any]) -> None:
    """Fill a built model: dense tensors as usual, each decoder linear as a QuantLinear (its packed modules'
    parts stacked, as the model class declares them) from its packed tensors."""
    check_config(method, qc)
    group = int(qc.get("group_size", qc.get("q_group_size")))
    quant = unpack_state(state, method, group)
    dense = {k: v for k, v in state.items() if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for base, w in quant.items():  # transient dense copies satisfy the loader; replaced just below
        dense[base + ".weight"] = dequantize(w)
    model.load_hf_state_dict(dense)  # type: ignore[operator]
    del dense
    install_quant_linears(model, quant, method)
