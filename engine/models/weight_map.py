"""How a model class names and splits its weights: the declarations each model class carries, and the readers that
the dense loader, the tensor-parallel sharder (engine/parallel/sharding.py) and the quantized loaders
(engine/quant/) share. Only the model classes hold weight names; everything outside engine/models/ asks here.

A model class declares, as class attributes (`DeclaresWeights`):
- `packed_modules_mapping` (nano-vllm's form): checkpoint module -> (the fused module it loads into, its position
  there). A fused weight is its parts stacked along the output dim in position order (q|k|v, gate|up).
- `tp_plan`: checkpoint module -> its `TPSplit`; a module the plan does not name is replicated on every rank. A
  key may name the module with its parent (`shared_expert.gate_proj`), which wins over the leaf alone.
  `expert_tp_plan` (MoE models) is the same for the modules inside an expert (`experts.{e}.`), whose leaves may
  repeat a dense MLP's (Qwen3-MoE's `gate_proj`) at another size.
- `checkpoint_prefix` and `top_level_modules`: the checkpoint stores the parameter `p` as `checkpoint_prefix + p`,
  except under the top-level modules (HF's `model.layers.0. ...` beside `lm_head.weight`).
- `checkpoint_renames`: a module name (one part of a path) the checkpoint spells otherwise (Mixtral's `mlp` is
  `block_sparse_moe`).
- `gguf_tensor_names`: llama.cpp's tensor names (`{}` stands for the block index) -> the model's module paths, and
  `gguf_permuted_heads`: the checkpoint modules whose rows llama.cpp permutes in llama-architecture files (for its
  rotary layout), each with the `ModelArch` field that counts its heads.

Modules are named by path (`layers.0.self_attn.qkv_proj`) or by leaf, the path's last part (`q_proj`); a
checkpoint key is a checkpoint module's path plus `.weight` or `.bias`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from torch import nn

# What tensor parallelism deals out among ranks, in engine/parallel/layout.py's `RankShard` runs: vocabulary rows,
# query heads, KV heads (whole GQA groups), MLP intermediate rows, each MoE expert's intermediate rows or the
# shared expert's.
SplitUnit = Literal["vocab", "q_heads", "kv_heads", "intermediate", "expert_intermediate",
                    "shared_expert_intermediate"]
_BLOCK_INDEX = re.compile(r"\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TPSplit:
    """One weight's tensor-parallel split: `dim` is cut into this rank's run of `unit`. Dim 0 (output rows) is
    column- or vocab-parallel, dim 1 (input columns) row-parallel; a row-parallel layer's bias is not split.
    Every split weight is [unit, hidden_size] (dim 0) or [hidden_size, unit] (dim 1)."""

    unit: SplitUnit
    dim: Literal[0, 1]


def column_parallel(unit: SplitUnit) -> TPSplit:
    return TPSplit(unit, 0)


def row_parallel(unit: SplitUnit) -> TPSplit:
    return TPSplit(unit, 1)


class DeclaresWeights(Protocol):
    """What a model class declares about its weights (see the module docstring)."""

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, int]]]
    tp_plan: ClassVar[Mapping[str, TPSplit]]
    expert_tp_plan: ClassVar[Mapping[str, TPSplit]]
    checkpoint_prefix: ClassVar[str]
    top_level_modules: ClassVar[tuple[str, ...]]
    checkpoint_renames: ClassVar[Mapping[str, str]]
    gguf_tensor_names: ClassVar[Mapping[str, str]]
    gguf_permuted_heads: ClassVar[Mapping[str, str]]


def leaf(path: str) -> str:
    return path.rpartition(".")[2]


def packed_parts(model: type[DeclaresWeights], module: str) -> list[str]:
    """The checkpoint modules (as paths beside `module`) that load into the model's module `module`, in order:
    its fused parts, or the module itself."""
    parent, _, name = module.rpartition(".")
    parts = sorted((position, part) for part, (fused, position) in model.packed_modules_mapping.items()
                   if fused == name)
    names = [part for _, part in parts] or [name]
    return [f"{parent}.{part}" if parent else part for part in names]


def checkpoint_path(model: type[DeclaresWeights], path: str) -> str:
    """A module or parameter path of the model as the checkpoint spells it."""
    top = path.partition(".")[0]
    if model.checkpoint_renames:
        path = ".".join(model.checkpoint_renames.get(part, part) for part in path.split("."))
    return path if top in model.top_level_modules else model.checkpoint_prefix + path


def checkpoint_keys(model: type[DeclaresWeights], param: str) -> list[str]:
    """The checkpoint tensors that load into the parameter `param`, in stacking order
    (`layers.0.self_attn.qkv_proj.weight` -> the q, k and v weights)."""
    module, _, kind = param.rpartition(".")
    return [f"{checkpoint_path(model, part)}.{kind}" for part in packed_parts(model, module)]


def checkpoint_modules(model: type[DeclaresWeights], module: str) -> list[str]:
    """The checkpoint modules (full checkpoint paths) that load into the model's module `module`, in order."""
    return [checkpoint_path(model, part) for part in packed_parts(model, module)]


def expert_index(key: str) -> int | None:
    """The expert an MoE checkpoint tensor belongs to (`...experts.3.gate_proj.weight` -> 3), else None."""
    match = _EXPERT_INDEX.search(key)
    return int(match.group(1)) if match else None


def tp_split(model: type[DeclaresWeights], key: str) -> TPSplit | None:
    """How tensor parallelism splits the checkpoint tensor `key` (None: replicated). A bias follows its weight's
    column split; a row-parallel bias is replicated, and so is anything else a split module holds (fp8 scales
    such as `k_proj.k_scale` or `q_proj.weight_scale`). An expert's weights split by `expert_tp_plan` (a rank
    whose shard holds experts whole, under expert parallelism, takes the full run)."""
    module, _, kind = key.rpartition(".")
    plan = model.expert_tp_plan if expert_index(key) is not None else model.tp_plan
    split = plan.get(".".join(module.split(".")[-2:])) or plan.get(leaf(module))
    if split is None or kind not in ("weight", "bias") or (kind == "bias" and split.dim != 0):
        return None
    return split


def fused_splits(model: type[DeclaresWeights], param: str) -> list[TPSplit] | None:
    """The splits of the parts stacked in the model's parameter `param`, in order (None: replicated)."""
    splits = [tp_split(model, key) for key in checkpoint_keys(model, param)]
    if all(split is None for split in splits):
        return None
    if any(split is None for split in splits):
        raise ValueError(f"{param}: its fused parts are split across ranks unevenly (the model's tp_plan)")
    return splits  # type: ignore[return-value]


def gguf_checkpoint_key(model: type[DeclaresWeights], gguf_name: str) -> str:
    """A GGUF tensor's name (`blk.3.attn_q.weight`) as the checkpoint spells it."""
    base, _, kind = gguf_name.rpartition(".")
    index = _BLOCK_INDEX.search(f".{base}.")
    template = _BLOCK_INDEX.sub(".{}.", f".{base}.", count=1)[1:-1]
    module = model.gguf_tensor_names.get(template)
    if module is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no mapping to the supported architectures")
    return f"{checkpoint_path(model, module.format(index.group(1)) if index else module)}.{kind}"


def is_norm_weight(param: str) -> bool:
    """Norm scales: initialized to one in dummy weights (the rest is drawn at random)."""
    return param.endswith("norm.weight")


def decoder_linear_paths(model: nn.Module) -> list[str]:
    """The module paths of the model's decoder-layer linears: what the quantized loaders replace (the embedding
    and the logits head are not among them). Paths, not modules, so a loader that swaps them one by one frees
    each dense weight as it goes."""
    layers: nn.Module = model.layers  # type: ignore[assignment]
    return [path for path, module in layers.named_modules(prefix="layers") if isinstance(module, nn.Linear)]


def replace_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)
