"""Dummy AWQ / GPTQ weights: `load_format="dummy"` with `quantization="awq"` or `"gptq"` (a preset, or any model
without a 4-bit checkpoint) runs the int4 kernels without a checkpoint.

Each decoder linear's checkpoint modules (q_proj, k_proj, ... as the model class names them) get random int4
codes, zero points and fp16 scales drawn straight in the checkpoint's packed layout (`qweight` / `qzeros` /
`scales` / `g_idx`, engine/quant/awq_gptq.py), and load through the same unpacking as a real checkpoint; the dense
tensors (embedding, norms, head) are the dense dummy weights.

Invariants:
- Every checkpoint module's draw is seeded by the engine seed and its checkpoint name alone, so the same seed gives
  the same model in every process (and would in every tensor-parallel rank), whatever the load order.
- `dummy_state` is a valid checkpoint state: written to safetensors beside a `quantization_config` of the same
  method and group size, it loads into exactly the model `load_dummy_awq_gptq` builds.
- Dequantized weights have the dense dummy weights' spread (std about DENSE_STD), so activations stay finite.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import torch
from torch import nn

from engine.models.arch import ModelArch
from engine.models.weight_map import checkpoint_modules, decoder_linear_paths, tp_split
from engine.quant.awq_gptq import AWQ_ORDER, SHIFTS, install_quant_linears, unpack_state

logger = logging.getLogger(__name__)

DEFAULT_GROUP = 128  # AutoAWQ's and vLLM's usual group size
GROUP_FALLBACKS = (128, 64, 32)  # group sizes the int4 kernels run, largest first
DENSE_STD = 0.02  # CausalLM.init_dummy_weights' std
CODE_STD = 4.7  # std of (q - z): q uniform in 0..15, z in 7..9
ZERO_LOW, ZERO_HIGH = 7, 9  # zero points drawn near the middle, so no group is all one sign


def name_seed(seed: int, name: str) -> int:
    """A generator seed from the engine seed and a checkpoint name (stable across processes, unlike hash())."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def dummy_group_size(model: nn.Module, requested: int | None) -> int:
    """The group size of the dummy weights: the requested one (a checkpoint config's), else DEFAULT_GROUP, or the
    largest kernel group dividing every decoder linear's input width (tiny test presets are narrower than 128)."""
    widths = {model.get_submodule(p).in_features for p in decoder_linear_paths(model)}
    if requested is not None:
        bad = sorted(w for w in widths if w % requested)
        if bad:
            raise ValueError(f"quantization group_size={requested} does not divide the linear input widths {bad}")
        return requested
    group = next((g for g in GROUP_FALLBACKS if all(w % g == 0 for w in widths)), None)
    if group is None:
        raise ValueError(f"no int4 group size ({', '.join(map(str, GROUP_FALLBACKS))}) divides the linear input "
                         f"widths {sorted(widths)}; dummy AWQ/GPTQ weights need one")
    if group != DEFAULT_GROUP:
        logger.info("dummy int4 weights: group_size %d (%d does not divide the input widths %s)", group,
                    DEFAULT_GROUP, sorted(widths))
    return group


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8], column 8c + order[i] into nibble i of word c (sequential if None):
    the inverse of awq_gptq's unpacking."""
    r, c = values.shape
    v = values.to(torch.int64).view(r, c // 8, 8)
    if order is not None:
        v = v[..., list(order)]
    words = (v << SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _random_words(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """int32 words whose eight nibbles are each uniform in 0..15."""
    return torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int64, generator=gen).to(torch.int32)


def draw_packed(method: str, base: str, out_features: int, in_features: int, group: int,
                seed: int) -> dict[str, torch.Tensor]:
    """One checkpoint module's packed tensors, in `method`'s layout (awq_gptq's module docstring)."""
    gen = torch.Generator().manual_seed(name_seed(seed, base))
    groups = in_features // group
    zeros = torch.randint(ZERO_LOW, ZERO_HIGH + 1, (groups, out_features), generator=gen)
    scales = (DENSE_STD / CODE_STD * (0.5 + torch.rand(groups, out_features, generator=gen))).half()
    if method == "awq":
        return {f"{base}.qweight": _random_words((in_features, out_features // 8), gen),
                f"{base}.qzeros": pack_nibbles(zeros, AWQ_ORDER), f"{base}.scales": scales}
    return {f"{base}.qweight": _random_words((in_features // 8, out_features), gen),
            f"{base}.qzeros": pack_nibbles((zeros - 1) & 0xF, None),  # GPTQ stores zero - 1
            f"{base}.scales": scales, f"{base}.g_idx": (torch.arange(in_features) // group).to(torch.int32)}


def part_rows(model: nn.Module, path: str, bases: list[str]) -> list[int]:
    """Output rows of each checkpoint module stacked into the linear at `path` (q|k|v, gate|up: from the
    model class's tensor-parallel units)."""
    linear = model.get_submodule(path)
    if len(bases) == 1:
        return [linear.out_features]
    arch: ModelArch = model.arch  # type: ignore[assignment]
    unit_rows = {"q_heads": arch.num_heads * arch.head_dim, "kv_heads": arch.num_kv_heads * arch.head_dim,
                 "intermediate": arch.intermediate_size}
    splits = [tp_split(type(model), f"{b}.weight") for b in bases]  # type: ignore[arg-type]
    rows = [unit_rows.get(s.unit, -1) if s is not None and s.dim == 0 else -1 for s in splits]
    if min(rows) < 0 or sum(rows) != linear.out_features:
        raise ValueError(f"{path}: cannot tell the rows of its parts {bases} for dummy int4 weights")
    return rows


def dummy_state(model: nn.Module, method: str, group: int, seed: int) -> dict[str, torch.Tensor]:
    """The packed tensors of every decoder linear's checkpoint modules (a checkpoint state, less the dense ones)."""
    state: dict[str, torch.Tensor] = {}
    for path in decoder_linear_paths(model):
        bases = checkpoint_modules(type(model), path)  # type: ignore[arg-type]
        in_features = model.get_submodule(path).in_features
        for base, rows in zip(bases, part_rows(model, path, bases), strict=True):
            state |= draw_packed(method, base, rows, in_features, group, seed)
    return state


def load_dummy_awq_gptq(model: nn.Module, method: str, qc: dict[str, Any], seed: int) -> None:
    """Dense dummy weights, then every decoder linear replaced by a QuantLinear of drawn int4 codes."""
    requested = qc.get("group_size", qc.get("q_group_size"))
    group = dummy_group_size(model, None if requested is None else int(requested))
    model.init_dummy_weights(seed)  # type: ignore[operator]
    device = model.get_submodule(decoder_linear_paths(model)[0]).weight.device
    quant = unpack_state(dummy_state(model, method, group, seed), method, group, device)
    install_quant_linears(model, quant, method)
