"""Dummy GGUF weights: `load_format="dummy"` with `quantization="gguf"` writes a GGUF file of the model's shapes
with random blocks at load (into a temporary directory, removed after loading) and loads it through the normal
GGUF path (engine/quant/gguf_weights.py), so the GGUF kernels run at any preset's shapes without carrying a file.

The file mirrors llama.cpp's Q4_1 quantizations of small models (SmolLM2's package among them): the decoder
linears Q4_1 (`linear_type`: Q4_0, Q4_1 or Q8_0), the token embedding and the untied output Q8_0, the norms F32
ones, other vectors (biases) F32. Tensor names are the model class's llama.cpp names (`gguf_tensor_names`).

Invariants:
- Every tensor's blocks are drawn from a generator seeded by the engine seed and its checkpoint name alone
  (engine/quant/dummy_int4.py's `name_seed`): the same seed writes the same file.
- Dequantized weights have the dense dummy weights' spread (std about DENSE_STD) and about zero mean.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from torch import nn

from engine.models.weight_map import checkpoint_keys, checkpoint_modules, checkpoint_path, is_norm_weight
from engine.quant.dummy_int4 import DENSE_STD, name_seed, part_rows
from engine.quant.gguf_weights import GGUF_GROUP, NATIVE_TYPES, load_gguf_quantized

DEFAULT_LINEAR_TYPE = "Q4_1"
TABLE_TYPE = "Q8_0"  # the token embedding and the untied output head
INT8_STD = 73.6  # std of int8 codes uniform in -127..127
NIBBLE_STD = 4.6  # std of 4-bit codes uniform in 0..15


def draw_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row]: `rows` x `cols` weights of `type_name` in GGUF's block layout."""
    if cols % GGUF_GROUP:
        raise ValueError(f"GGUF {type_name} rows need a multiple of {GGUF_GROUP} elements, got {cols}")
    nb = cols // GGUF_GROUP
    code_std = INT8_STD if type_name == "Q8_0" else NIBBLE_STD
    d = (DENSE_STD / code_std * (0.5 + rng.random((rows, nb), dtype=np.float32))).astype(np.float16)
    parts = [d.view(np.uint8).reshape(rows, nb, 2)]
    if type_name == "Q4_1":  # d, m, nibbles; w = d * q + m, m = -7.5 d centres q's 0..15
        parts.append((-7.5 * d.astype(np.float32)).astype(np.float16).view(np.uint8).reshape(rows, nb, 2))
    if type_name in ("Q4_0", "Q4_1"):  # Q4_0: d, nibbles; w = d * (q - 8)
        parts.append(rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8))
    elif type_name == "Q8_0":  # d, 32 int8 codes
        parts.append(rng.integers(-127, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8))
    else:
        raise ValueError(f"dummy GGUF type {type_name!r}: choose one of {', '.join(NATIVE_TYPES)}")
    return np.concatenate(parts, axis=2).reshape(rows, -1)


def gguf_names(model: nn.Module) -> dict[str, str]:
    """Checkpoint module path -> llama.cpp tensor name (without .weight / .bias), from the model class's
    declarations (the reverse of `gguf_checkpoint_key`)."""
    cls = type(model)
    names: dict[str, str] = {}
    for template, module in cls.gguf_tensor_names.items():  # type: ignore[attr-defined]
        if "{}" not in template:
            names[checkpoint_path(cls, module)] = template  # type: ignore[arg-type]
            continue
        for i in range(len(model.layers)):  # type: ignore[arg-type]
            names[checkpoint_path(cls, module.format(i))] = template.format(i)  # type: ignore[arg-type]
    return names


def _matrices(model: nn.Module, linear_type: str) -> list[tuple[str, str, int, int]]:
    """(checkpoint module, GGUF type, rows, cols) of every weight matrix (the fused linears' parts apart)."""
    out = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            (base,) = checkpoint_modules(type(model), path)  # type: ignore[arg-type]
            out.append((base, TABLE_TYPE, module.num_embeddings, module.embedding_dim))
        elif isinstance(module, nn.Linear):
            bases = checkpoint_modules(type(model), path)  # type: ignore[arg-type]
            kind = TABLE_TYPE if module is model.head_module() else linear_type  # type: ignore[operator]
            for base, rows in zip(bases, part_rows(model, path, bases), strict=True):
                out.append((base, kind, rows, module.in_features))
    return out


def write_dummy_gguf(model: nn.Module, path: str | Path, architecture: str, seed: int,
                     linear_type: str = DEFAULT_LINEAR_TYPE) -> Path:
    """Write a GGUF file of `model`'s shapes with random weights (see the module docstring); `architecture` is
    the file's `general.architecture` (the HF model_type: "llama" makes the loader undo llama.cpp's Q/K row
    permutation, as for a real file)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    names = gguf_names(model)
    arch = model.arch  # type: ignore[attr-defined]
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(arch.num_layers)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    for base, type_name, rows, cols in _matrices(model, linear_type):
        blocks = draw_blocks(type_name, rows, cols, np.random.default_rng(name_seed(seed, base)))
        writer.add_tensor(f"{names[base]}.weight", blocks, raw_dtype=GGMLQuantizationType[type_name])
    matrices = {p for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if module in matrices and kind == "weight":
            continue
        keys = checkpoint_keys(type(model), name)  # type: ignore[arg-type]
        sizes = [param.shape[0]] if len(keys) == 1 else part_rows(  # a fused bias: its parts' rows
            model, module, checkpoint_modules(type(model), module))  # type: ignore[arg-type]
        for key, rows in zip(keys, sizes, strict=True):
            base, _, kind = key.rpartition(".")
            rng = np.random.default_rng(name_seed(seed, key))
            values = np.ones(rows, np.float32) if is_norm_weight(name) else \
                rng.standard_normal(rows, dtype=np.float32) * DENSE_STD
            writer.add_tensor(f"{names[base]}.{kind}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def load_dummy_gguf(model: nn.Module, architecture: str, seed: int) -> None:
    """Write the dummy GGUF file into a temporary directory and load it as a real one."""
    with tempfile.TemporaryDirectory(prefix="kvflow-dummy-gguf-") as folder:
        path = write_dummy_gguf(model, Path(folder) / "dummy.gguf", architecture, seed)
        load_gguf_quantized(model, path)
