"""One rank's paged KV cache: its geometry and dtype, how many blocks a budget holds, its allocation on the
device, the CPU swap space beside it, and the fp8 scales its values are stored with.

Invariants:
- Per layer a (K, V) pair of [num_blocks, block_size, num_kv_heads, head_dim] tensors (engine/runner/attention.py),
  with this rank's KV heads only, in the KV dtype: the model's, or float8 e4m3 under `--kv-cache-dtype fp8`.
- Block 0 pads block tables and is never handed out, so a cache must hold at least 2 blocks.
- Caches are allocated zeroed: padding slots are read (then masked), and 0 * garbage could be NaN.
- Swapping moves whole blocks between the device cache and the host swap cache of the same geometry; fp8 blocks
  move as bytes (CPU tensors have no float8 index_put).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.quant.kv_fp8 import DEFAULT_KV_SCALES, checkpoint_kv_scales
from engine.runner.attention import KVCache

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 4 << 30  # vLLM's CPU backend default KV space


def kv_cache_dtype(kv_cache_dtype_flag: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: fp8 e4m3 (per-tensor scales on the attention modules, engine/quant/kv_fp8.py), else
    the model's dtype."""
    return torch.float8_e4m3fn if kv_cache_dtype_flag == "fp8_e4m3" else model_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape and dtype of one rank's KV cache, whatever its number of blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.block_size * 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def num_blocks_in(self, budget: int) -> int:
        """Blocks a byte budget holds; raises when that is fewer than the 2 a cache needs."""
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds fewer than 2 blocks of {self.block_bytes}")
        return num_blocks

    def allocate(self, num_blocks: int, device: torch.device) -> list[KVCache]:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=device),
                 torch.zeros(shape, dtype=self.dtype, device=device))
                for _ in range(self.num_layers)]

    def allocate_swap(self, num_blocks: int, pin: bool) -> list[KVCache]:
        """Host swap space (pinned when the cache is on a GPU); none for 0 blocks."""
        if not num_blocks:
            return []
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, pin_memory=pin),
                 torch.zeros(shape, dtype=self.dtype, pin_memory=pin))
                for _ in range(self.num_layers)]


    def allocate_host_pool(self, num_slots: int, pin: bool) -> torch.Tensor:
        """The host KV tier's pool (engine/runner/kv_tier.py): [slots, 2 x layers, block elements], slot-major so
        that a block is one contiguous transfer; pinned beside a GPU cache. One allocation (the pinned allocator
        rounds it up to a power of two of bytes, as it did each of the per-layer tensors before)."""
        elements = self.block_size * self.num_kv_heads * self.head_dim
        return torch.zeros((num_slots, 2 * self.num_layers, elements), dtype=self.dtype, pin_memory=pin)


def swap_blocks(device_caches: list[KVCache], host_caches: list[KVCache], pairs: list[tuple[int, int]],
                to_host: bool) -> None:
    """Copy blocks (source id, destination id) from the device cache to the host swap cache, or back."""
    if not pairs:
        return
    src_ids = torch.as_tensor([p[0] for p in pairs], dtype=torch.int64)
    dst_ids = torch.as_tensor([p[1] for p in pairs], dtype=torch.int64)
    for (dev_k, dev_v), (cpu_k, cpu_v) in zip(device_caches, host_caches, strict=True):
        device = dev_k.device
        if dev_k.dtype == torch.float8_e4m3fn:  # moved as bytes (no float8 index_put on CPU)
            dev_k, dev_v, cpu_k, cpu_v = (t.view(torch.uint8) for t in (dev_k, dev_v, cpu_k, cpu_v))
        if to_host:
            cpu_k[dst_ids] = dev_k[src_ids.to(device)].cpu()
            cpu_v[dst_ids] = dev_v[src_ids.to(device)].cpu()
        else:
            dev_k[dst_ids.to(device)] = cpu_k[src_ids].to(device)
            dev_v[dst_ids.to(device)] = cpu_v[src_ids].to(device)


def set_kv_scales(model: torch.nn.Module, model_path: str | None) -> None:
    """fp8 KV cache: each layer's calibrated (k_scale, v_scale) from the checkpoint, else 1.0 (engine/quant/kv_fp8.py)."""
    layers = model.layers
    scales = checkpoint_kv_scales(model_path, len(layers), type(model).attention_checkpoint_prefix)
    for layer, pair in zip(layers, scales or [DEFAULT_KV_SCALES] * len(layers), strict=True):
        layer.self_attn.kv_scales = pair
    if scales is None:
        logger.info("fp8 KV cache: the checkpoint calibrates no KV scales; k_scale = v_scale = 1.0")
    else:
        ks, vs = [k for k, _ in scales], [v for _, v in scales]
        logger.info("fp8 KV cache: per-layer scales from the checkpoint (k_scale %.3g-%.3g, v_scale %.3g-%.3g)",
                    min(ks), max(ks), min(vs), max(vs))
