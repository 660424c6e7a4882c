"""GGUF weights kept quantized (`--quantization gguf`): Q4_0 / Q4_1 / Q8_0 tensors go into the canonical group
layout of engine/quant/group_quant.py without dequantizing; other tensor types (F32 norms, F16, K-quants) are
dequantized to the model dtype by the gguf package and logged.

Tensor names, and the Q/K row order of Llama-architecture files (llama.cpp permutes those rows for its rotary
layout; transformers' `LlamaTensorProcessor` undoes it), follow transformers' GGUF loader, which produces the
default dequantized form: the same rows in the same order, so both forms compute the same function.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.quant.group_quant import QuantWeight, dequantize
from engine.quant.quant_layers import QuantEmbedding, QuantLinear

logger = logging.getLogger(__name__)

NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")
GGUF_GROUP = 32
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: quantized (`quant`) or dense float32 (`dense`)."""

    name: str  # HF name (model.layers.0.self_attn.q_proj.weight)
    type_name: str
    quant: QuantWeight | None
    dense: torch.Tensor | None


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{suffix}"
    if base == "output_norm":
        return f"model.norm.{suffix}"
    if base == "output":
        return f"lm_head.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no mapping to the supported architectures")


def blocks_to_quant(type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantWeight:
    """Raw GGUF blocks [rows, bytes per row] -> QuantWeight (bit-exact repacking, no arithmetic)."""
    nb = cols // GGUF_GROUP
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, nb, -1).copy())

    def f16(a: int, b: int) -> torch.Tensor:  # float16 bits, [rows, nb]
        return data[:, :, a:b].contiguous().view(torch.int16).reshape(rows, nb)

    if type_name == "Q4_1":  # block: d f16, m f16, 16 bytes of nibbles
        return QuantWeight(4, "min", GGUF_GROUP, rows, cols, data[:, :, 4:20].reshape(rows, cols // 2).contiguous(),
                           f16(0, 2), mins=f16(2, 4))
    if type_name == "Q4_0":  # block: d f16, 16 bytes of nibbles; w = d * (q - 8)
        return QuantWeight(4, "zero", GGUF_GROUP, rows, cols, data[:, :, 2:18].reshape(rows, cols // 2).contiguous(),
                           f16(0, 2), zeros=torch.full((rows, nb), 8, dtype=torch.uint8))
    if type_name == "Q8_0":  # block: d f16, 32 int8
        return QuantWeight(8, "sym", GGUF_GROUP, rows, cols,
                           data[:, :, 2:34].reshape(rows, cols).contiguous().view(torch.int8), f16(0, 2))
    raise ValueError(f"GGUF type {type_name} is not stored natively")


def qk_row_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (transformers' `_reverse_permute_weights` on indices)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def read_gguf(path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, GGUFTensor]:
    """Every tensor of a GGUF file under its HF name; Q4_0 / Q4_1 / Q8_0 stay quantized."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    out: dict[str, GGUFTensor] = {}
    dense_types: dict[str, int] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        type_name = t.tensor_type.name
        shape = [int(s) for s in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
        perm = None
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name) and name.endswith(".weight"):
            perm = qk_row_permutation(shape[0], num_heads if ".q_proj." in name else num_kv_heads)
        if type_name in NATIVE_TYPES and len(shape) == 2:
            quant = blocks_to_quant(type_name, t.data, shape[0], shape[1])
            out[name] = GGUFTensor(name, type_name, quant.rows(perm) if perm is not None else quant, None)
            continue
        dense = torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        if perm is not None:
            dense = dense[perm].contiguous()
        out[name] = GGUFTensor(name, type_name, None, dense)
        if len(shape) == 2:
            dense_types[type_name] = dense_types.get(type_name, 0) + 1
    if dense_types:
        logger.info("GGUF matrices dequantized (no native kernel for their type): %s", dense_types)
    return out


def _fused(parts: list[GGUFTensor], what: str) -> QuantWeight | torch.Tensor:
    """Stack q|k|v or gate|up: quantized when every part is and the formats agree, else dequantized."""
    quants = [p.quant for p in parts]
    if all(q is not None for q in quants):
        try:
            return QuantWeight.cat(quants)  # type: ignore[arg-type]
        except ValueError as exc:
            logger.info("%s: %s; dequantizing it", what, exc)
    logger.info("%s: types %s not all native; dequantized", what, [p.type_name for p in parts])
    return torch.cat([p.dense if p.dense is not None else dequantize(p.quant) for p in parts], dim=0)  # type: ignore[arg-type]


def _set_linear(parent: nn.Module, attr: str, weight: QuantWeight | torch.Tensor, bias: torch.Tensor | None) -> None:
    old = getattr(parent, attr)
    if isinstance(weight, QuantWeight):  # read on the host; held where the model is (kn layout on CUDA)
        setattr(parent, attr, QuantLinear(weight.to(old.weight.device),
                                          None if bias is None else bias.to(old.weight.device, old.weight.dtype)))
        return
    with torch.no_grad():
        old.weight.copy_(weight)
        if bias is not None:
            old.bias.copy_(bias)


def load_gguf_quantized(model: nn.Module, gguf_path: str | Path) -> None:
    """Fill a freshly built `CausalLM` from a GGUF file, replacing its linears (and the embedding / head) with
    quantized modules where the tensor type allows; the dense tensors (norms, ...) are copied in."""
    arch = model.arch  # type: ignore[attr-defined]
    tensors = read_gguf(gguf_path, arch.num_heads, arch.num_kv_heads)
    dtype = model.norm.weight.dtype  # type: ignore[union-attr]
    used: set[str] = set()

    def take(name: str) -> GGUFTensor:
        if name not in tensors:
            raise ValueError(f"GGUF file {gguf_path} lacks tensor {name}")
        used.add(name)
        return tensors[name]

    def dense(name: str) -> torch.Tensor:
        t = take(name)
        return t.dense if t.dense is not None else dequantize(t.quant)  # type: ignore[arg-type]

    def copy(param: torch.Tensor, name: str) -> None:
        with torch.no_grad():
            param.copy_(dense(name))

    embed = take("model.embed_tokens.weight")
    if embed.quant is not None:
        model.embed_tokens = QuantEmbedding(embed.quant.to(model.norm.weight.device), dtype)  # type: ignore[assignment, union-attr]
    else:
        copy(model.embed_tokens.weight, embed.name)  # type: ignore[union-attr]
    copy(model.norm.weight, "model.norm.weight")  # type: ignore[union-attr]
    if model.lm_head is not None:  # type: ignore[attr-defined]
        head = take("lm_head.weight")
        _set_linear(model, "lm_head", head.quant if head.quant is not None else head.dense, None)  # type: ignore[arg-type]
    head_module = model.lm_head if model.lm_head is not None else model.embed_tokens  # type: ignore[attr-defined]
    if isinstance(head_module, (QuantLinear, QuantEmbedding)):  # the logits head override (any device)
        model.cpu_logits_head = head_module if isinstance(head_module, QuantLinear) else head_module.logits  # type: ignore[assignment]
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        src = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [take(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
        bias = torch.cat([dense(f"{src}self_attn.{p}_proj.bias") for p in "qkv"]) if arch.qkv_bias else None
        _set_linear(attn, "qkv_proj", _fused(qkv, f"layer {i} qkv"), bias)
        o = take(f"{src}self_attn.o_proj.weight")
        _set_linear(attn, "o_proj", o.quant if o.quant is not None else o.dense, None)  # type: ignore[arg-type]
        gate_up = [take(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]
        _set_linear(mlp, "gate_up_proj", _fused(gate_up, f"layer {i} gate_up"), None)
        down = take(f"{src}mlp.down_proj.weight")
        _set_linear(mlp, "down_proj", down.quant if down.quant is not None else down.dense, None)  # type: ignore[arg-type]
        copy(layer.input_layernorm.weight, f"{src}input_layernorm.weight")
        copy(layer.post_attention_layernorm.weight, f"{src}post_attention_layernorm.weight")
        if arch.qk_norm:
            copy(attn.q_norm.weight, f"{src}self_attn.q_norm.weight")
            copy(attn.k_norm.weight, f"{src}self_attn.k_norm.weight")
        layer.small_gemm = False  # the fused single-row GEMVs read dense `.weight`s
    unused = set(tensors) - used
    if unused:
        raise ValueError(f"GGUF tensors not used by the model: {', '.join(sorted(unused))}")
