"""GGUF weights kept quantized (`--quantization gguf`): Q4_0 / Q4_1 / Q8_0 tensors go into the canonical group
layout of engine/quant/group_quant.py without dequantizing; other tensor types (F32 norms, F16, K-quants) are
dequantized to the model dtype by the gguf package and logged.

Tensor names, and the Q/K row order of Llama-architecture files (llama.cpp permutes those rows for its rotary
layout; transformers' `LlamaTensorProcessor` undoes it), follow transformers' GGUF loader, which produces the
default dequantized form: the same rows in the same order, so both forms compute the same function. The names and
the permuted modules are the model class's declarations (`gguf_tensor_names`, `gguf_permuted_heads`:
engine/models/weight_map.py); the loader walks the built model's modules and fills each from its checkpoint names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.models.arch import ModelArch
from engine.models.registry import model_class
from engine.models.weight_map import checkpoint_keys, gguf_checkpoint_key, leaf, replace_module
from engine.quant.group_quant import QuantWeight, dequantize
from engine.quant.quant_layers import QuantEmbedding, QuantLinear

logger = logging.getLogger(__name__)

NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")
GGUF_GROUP = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: quantized (`quant`) or dense float32 (`dense`)."""

    name: str  # its checkpoint (HF) name, as the model class spells it
    type_name: str
    quant: QuantWeight | None
    dense: torch.Tensor | None


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


def read_gguf(path: str | Path, arch: ModelArch) -> dict[str, GGUFTensor]:
    """Every tensor of a GGUF file under its HF name (`arch`'s model class names them); Q4_0 / Q4_1 / Q8_0 stay
    quantized."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    model = model_class(arch.architecture)
    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    file_arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    out: dict[str, GGUFTensor] = {}
    dense_types: dict[str, int] = {}
    for t in reader.tensors:
        name = gguf_checkpoint_key(model, t.name)
        type_name = t.tensor_type.name
        shape = [int(s) for s in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
        module, _, kind = name.rpartition(".")
        heads = model.gguf_permuted_heads.get(leaf(module)) if file_arch == "llama" and kind == "weight" else None
        perm = qk_row_permutation(shape[0], getattr(arch, heads)) if heads is not None else None
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


def _set_linear(old: nn.Module, weight: QuantWeight | torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """The linear to hold `weight`: a new QuantLinear, or `old` with the dense values copied in."""
    if isinstance(weight, QuantWeight):  # read on the host; held where the model is (kn layout on CUDA)
        return QuantLinear(weight.to(old.weight.device),
                           None if bias is None else bias.to(old.weight.device, old.weight.dtype))
    with torch.no_grad():
        old.weight.copy_(weight)
        if bias is not None:
            old.bias.copy_(bias)
    return old


class _FileTensors:
    """A GGUF file's tensors by checkpoint name, remembering which ones the model took."""

    def __init__(self, tensors: dict[str, GGUFTensor], path: str | Path) -> None:
        self.tensors, self.path = tensors, path
        self.used: set[str] = set()

    def take(self, key: str) -> GGUFTensor:
        if key not in self.tensors:
            raise ValueError(f"GGUF file {self.path} lacks tensor {key}")
        self.used.add(key)
        return self.tensors[key]

    def dense(self, key: str) -> torch.Tensor:
        t = self.take(key)
        return t.dense if t.dense is not None else dequantize(t.quant)  # type: ignore[arg-type]

    def check_all_used(self) -> None:
        unused = set(self.tensors) - self.used
        if unused:
            raise ValueError(f"GGUF tensors not used by the model: {', '.join(sorted(unused))}")


def _load_linear(model: nn.Module, path: str, linear: nn.Linear, tensors: _FileTensors) -> None:
    declarations = type(model)
    parts = [tensors.take(key) for key in checkpoint_keys(declarations, f"{path}.weight")]  # type: ignore[arg-type]
    if len(parts) > 1:
        weight = _fused(parts, path)
    else:
        weight = parts[0].quant if parts[0].quant is not None else parts[0].dense  # type: ignore[assignment]
    bias = None if linear.bias is None else torch.cat(
        [tensors.dense(key) for key in checkpoint_keys(declarations, f"{path}.bias")])  # type: ignore[arg-type]
    replace_module(model, path, _set_linear(linear, weight, bias))


def _load_embedding(model: nn.Module, path: str, embedding: nn.Embedding, tensors: _FileTensors) -> None:
    embed = tensors.take(checkpoint_keys(type(model), f"{path}.weight")[0])  # type: ignore[arg-type]
    if embed.quant is not None:
        replace_module(model, path, QuantEmbedding(embed.quant.to(embedding.weight.device), embedding.weight.dtype))
        return
    with torch.no_grad():
        embedding.weight.copy_(embed.dense)  # type: ignore[arg-type]


def load_gguf_quantized(model: nn.Module, gguf_path: str | Path) -> None:
    """Fill a freshly built model from a GGUF file, replacing its linears (and the embedding / head) with
    quantized modules where the tensor type allows; the dense tensors (norms, ...) are copied in."""
    tensors = _FileTensors(read_gguf(gguf_path, model.arch), gguf_path)  # type: ignore[arg-type]
    for path, module in list(model.named_modules()):  # a snapshot: loading replaces modules
        if isinstance(module, nn.Linear):
            _load_linear(model, path, module, tensors)
        elif isinstance(module, nn.Embedding):
            _load_embedding(model, path, module, tensors)
        else:  # the norms' scales
            for name, param in module.named_parameters(recurse=False):
                key = checkpoint_keys(type(model), f"{path}.{name}")[0]  # type: ignore[arg-type]
                with torch.no_grad():
                    param.copy_(tensors.dense(key))
    head = model.head_module()  # type: ignore[operator]
    if isinstance(head, (QuantLinear, QuantEmbedding)):  # the logits head override (any device)
        model.cpu_logits_head = head if isinstance(head, QuantLinear) else head.logits  # type: ignore[assignment]
    for layer in model.layers:  # type: ignore[attr-defined]
        layer.small_gemm = False  # the fused single-row GEMVs read dense `.weight`s
    tensors.check_all_used()
