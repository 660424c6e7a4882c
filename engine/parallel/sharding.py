"""Each rank's weights: read only its slices from the safetensors (`load_sharded_state`), or, for dummy weights,
draw the full tensor exactly as the unsharded model would and keep this rank's slice (`init_dummy_sharded`), so
TP=N and TP=1 hold the same model in both cases.

GGUF checkpoints are dequantized once into a cached safetensors directory (engine/models/loader.py), so they load
sharded too. Dummy weights are generated full-size one tensor at a time and sliced (transient: the largest
tensor, never the whole model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import ModelNotAvailable
from engine.models.arch import ModelArch
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


def load_sharded_state(path: str, arch: ModelArch, shard: RankShard) -> dict[str, torch.Tensor]:
    """HF-named tensors of this rank's shard, read slice by slice from the safetensors files (no full tensor of a
    split weight is ever read)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelNotAvailable(f"no *.safetensors weights in {path}")
    hd = arch.head_dim
    q_rows = _head_rows(*shard.q_heads, hd)
    inter = shard.intermediate
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = handle.get_slice(key)
                if key in ("model.embed_tokens.weight", "lm_head.weight"):
                    state[key] = sl[shard.vocab[0] : shard.vocab[1]]
                elif key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                    state[key] = sl[q_rows[0] : q_rows[1]]
                elif key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                                   "self_attn.v_proj.bias")):
                    state[key] = _kv_take(sl, shard.kv_heads, hd)
                elif key.endswith("self_attn.o_proj.weight"):
                    state[key] = sl[:, q_rows[0] : q_rows[1]]
                elif key.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
                    state[key] = sl[inter[0] : inter[1]]
                elif key.endswith("mlp.down_proj.weight"):
                    state[key] = sl[:, inter[0] : inter[1]]
                else:  # norms: replicated
                    state[key] = handle.get_tensor(key)
    return state


def full_fused_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """The unsharded shape of one of the model's (fused) parameters."""
    h, hd = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * hd
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return (arch.vocab_size, h)
    if name.endswith("qkv_proj.weight"):
        return (qkv, h)
    if name.endswith("qkv_proj.bias"):
        return (qkv,)
    if name.endswith("o_proj.weight"):
        return (h, arch.num_heads * hd)
    if name.endswith("gate_up_proj.weight"):
        return (2 * arch.intermediate_size, h)
    if name.endswith("down_proj.weight"):
        return (h, arch.intermediate_size)
    raise ValueError(f"{name} is not split across ranks")


def shard_fused(name: str, full: torch.Tensor, arch: ModelArch, shard: RankShard) -> torch.Tensor:
    """This rank's slice of a full (fused-layout) parameter: q|k|v and gate|up are sliced part by part."""
    hd = arch.head_dim
    q0, q1 = _head_rows(*shard.q_heads, hd)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return full[shard.vocab[0] : shard.vocab[1]]
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        q, k, v = full.split([arch.num_heads * hd, arch.num_kv_heads * hd, arch.num_kv_heads * hd])
        return torch.cat([q[q0:q1], _kv_take(k, shard.kv_heads, hd), _kv_take(v, shard.kv_heads, hd)])
    if name.endswith("o_proj.weight"):
        return full[:, q0:q1]
    i0, i1 = shard.intermediate
    if name.endswith("gate_up_proj.weight"):
        gate, up = full.split(arch.intermediate_size)
        return torch.cat([gate[i0:i1], up[i0:i1]])
    if name.endswith("down_proj.weight"):
        return full[:, i0:i1]
    return full


def init_dummy_sharded(model: nn.Module, seed: int, arch: ModelArch, shard: RankShard) -> None:
    """`CausalLM.init_dummy_weights` of the full model, sliced: each split tensor is drawn at full size with the
    same generator as TP=1 and only this rank's slice kept."""
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device).manual_seed(seed * 1000 + index)
            full = torch.empty(full_fused_shape(name, arch), dtype=param.dtype, device=param.device)
            full.normal_(0.0, 0.02, generator=gen)
            param.copy_(shard_fused(name, full, arch, shard))
            del full
