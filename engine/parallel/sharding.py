"""Each rank's weights: read only its slices from the safetensors (`load_sharded_state`), or, for dummy weights,
draw the full tensor exactly as the unsharded model would and keep this rank's slice (`init_dummy_sharded`), so
TP=N and TP=1 hold the same model in both cases.

GGUF checkpoints are dequantized once into a cached safetensors directory (engine/models/loader.py), so they load
sharded too. Dummy weights are generated full-size one tensor at a time and sliced (transient: the largest
tensor, never the whole model).

Which weight splits how comes from the model class's declarations (`tp_plan`, `packed_modules_mapping`: engine/models/
weight_map.py); this module knows only what each split unit means for a rank (`RankShard`'s runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import ModelNotAvailable
from engine.models.arch import ModelArch
from engine.models.registry import model_class
from engine.models.weight_map import (
    TPSplit,
    checkpoint_keys,
    expert_index,
    fused_splits,
    is_norm_weight,
    tp_split,
)
from engine.parallel.layout import RankShard


def _head_rows(first: int, last: int, head_dim: int) -> tuple[int, int]:
    return first * head_dim, last * head_dim


def _kv_take(source: Any, kv_heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Rows of the KV heads `kv_heads` (in that order, repeats allowed) from a [kv * head_dim, ...] source that
    supports slicing (a tensor or a safetensors slice): one contiguous read, then a gather if needed."""
    lo, hi = min(kv_heads), max(kv_heads) + 1
    block = source[lo * head_dim : hi * head_dim]
    if list(kv_heads) == list(range(lo, hi)):
        return block
    index = torch.tensor([(k - lo) * head_dim + d for k in kv_heads for d in range(head_dim)])
    return block.index_select(0, index)


def _unit_size(split: TPSplit, arch: ModelArch) -> int:
    """The full length of a split dim."""
    hd = arch.head_dim
    sizes = {"vocab": arch.vocab_size, "q_heads": arch.num_heads * hd, "kv_heads": arch.num_kv_heads * hd,
             "intermediate": arch.intermediate_size,
             "expert_intermediate": arch.moe.expert_intermediate_size if arch.moe is not None else 0,
             "shared_expert_intermediate": arch.moe.shared_expert_intermediate_size if arch.moe is not None else 0}
    return sizes[split.unit]


def _take(source: Any, split: TPSplit, arch: ModelArch, shard: RankShard) -> torch.Tensor:
    """This rank's run of `source` (a tensor or a safetensors slice) along the split dim."""
    if split.unit == "kv_heads":  # whole heads, possibly repeated: gathered rows
        if split.dim != 0:
            raise ValueError("KV heads split the output rows only")
        return _kv_take(source, shard.kv_heads, arch.head_dim)
    runs = {"vocab": shard.vocab, "q_heads": _head_rows(*shard.q_heads, arch.head_dim),
            "intermediate": shard.intermediate, "expert_intermediate": shard.expert_intermediate,
            "shared_expert_intermediate": shard.shared_expert_intermediate}
    start, end = runs[split.unit]
    return source[start:end] if split.dim == 0 else source[:, start:end]


def held_checkpoint_keys(model: nn.Module) -> set[str]:
    """The checkpoint keys behind the parameters this rank holds (a pipeline stage's: not on the meta device)."""
    return {key for name, param in model.named_parameters() if not param.is_meta
            for key in checkpoint_keys(type(model), name)}  # type: ignore[arg-type]


def load_sharded_state(path: str, arch: ModelArch, shard: RankShard,
                       keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors of this rank's shard, read slice by slice from the safetensors files (no full tensor of a
    split weight is ever read); only `keys` when given (a pipeline stage's, `held_checkpoint_keys`)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelNotAvailable(f"no *.safetensors weights in {path}")
    model = model_class(arch.architecture)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keys is not None and key not in keys:
                    continue
                expert = expert_index(key)
                if expert is not None and not shard.experts[0] <= expert < shard.experts[1]:
                    continue  # another expert-parallel rank's expert
                split = tp_split(model, key)
                if split is None:  # replicated (norms)
                    state[key] = handle.get_tensor(key)
                else:
                    state[key] = _take(handle.get_slice(key), split, arch, shard)
    return state


def _full_shape(name: str, splits: list[TPSplit], arch: ModelArch) -> tuple[int, ...]:
    """The unsharded shape of a parameter whose parts (stacked along dim 0) split as `splits`."""
    if splits[0].dim == 1:
        if len(splits) != 1:
            raise ValueError(f"{name}: a row-parallel weight has one part")
        return (arch.hidden_size, _unit_size(splits[0], arch))
    rows = sum(_unit_size(split, arch) for split in splits)
    return (rows,) if name.endswith(".bias") else (rows, arch.hidden_size)


def _shard_stacked(full: torch.Tensor, splits: list[TPSplit], arch: ModelArch, shard: RankShard) -> torch.Tensor:
    """This rank's slice of a full parameter: each stacked part (q|k|v, gate|up) sliced on its own."""
    if splits[0].dim == 1:
        return _take(full, splits[0], arch, shard)
    parts = full.split([_unit_size(split, arch) for split in splits])
    return torch.cat([_take(part, split, arch, shard) for part, split in zip(parts, splits, strict=True)])


def init_dummy_sharded(model: nn.Module, seed: int, arch: ModelArch, shard: RankShard) -> None:
    """`CausalLM.init_dummy_weights` of the full model, sliced: each split tensor is drawn at full size with the
    same generator as TP=1 and only this rank's slice kept; a replicated one (an MoE router, a whole expert) is
    drawn as TP=1 draws it."""
    declarations = type(model)
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if param.is_meta:  # another pipeline stage's
                continue
            if is_norm_weight(name):
                param.fill_(1.0)
                continue
            splits = fused_splits(declarations, name)  # type: ignore[arg-type]
            gen = torch.Generator(device=param.device).manual_seed(model.dummy_seed(seed, index, name))  # type: ignore[operator]
            if splits is None:
                param.normal_(0.0, 0.02, generator=gen)
                continue
            full = torch.empty(_full_shape(name, splits, arch), dtype=param.dtype, device=param.device)
            full.normal_(0.0, 0.02, generator=gen)
            param.copy_(_shard_stacked(full, splits, arch, shard))
            del full
