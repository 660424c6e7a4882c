"""Tiles of the grouped MoE GEMMs (kernels/fused_moe.py): per-GPU tables recorded by a sweep, else a heuristic.

As vLLM records its fused-MoE configs: one JSON file per (experts on a rank, intermediate size on a rank, GPU
name) under kernels/moe_tile_tables/, `{"tiles": {"<tokens>": {block_m, block_n, block_k, group_m, num_warps,
num_stages}}, ...}`, written by `python -m bench.moe_pp_x4 --parts tiles` (the best of its candidates at each
token count, timed through `fused_moe`). A batch takes the entry of the nearest recorded token count; a shape or
GPU without a table takes `moe_tiles`' heuristic. Tables are read once per process (`load_table` is cached: the
files do not change while an engine runs).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TABLE_DIR", "MoeTiles", "load_table", "moe_tiles", "nearest", "select_tiles", "table_name"]

TABLE_DIR = Path(__file__).resolve().parent / "moe_tile_tables"


@dataclass(frozen=True)
class MoeTiles:
    """One GEMM's tile shape and launch settings."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def moe_tiles(num_slots: int, num_experts: int) -> MoeTiles:
    """The heuristic where no table is recorded: decode-sized batches spread few slots over many experts, so a
    16-row tile wastes least padding; large prefill batches fill 64-row tiles."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert <= 16:
        return MoeTiles(16, 64, 128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeTiles(32, 64, 64, num_warps=4, num_stages=4)
    return MoeTiles(64, 128, 64, num_warps=8, num_stages=3)


def table_name(num_experts: int, inter: int, device_name: str) -> str:
    """vLLM's file naming: E = experts on the rank, N = each expert's intermediate size on the rank."""
    return f"E={num_experts},N={inter},device_name={device_name.replace(' ', '_')}.json"


@functools.cache
def load_table(num_experts: int, inter: int, device_name: str, directory: Path = TABLE_DIR
               ) -> tuple[tuple[int, MoeTiles], ...]:
    """(token count, tiles) pairs of the recorded table, ascending; empty when none is recorded."""
    path = directory / table_name(num_experts, inter, device_name)
    if not path.exists():
        return ()
    entries = json.loads(path.read_text())["tiles"]
    return tuple(sorted((int(tokens), MoeTiles(**tiles)) for tokens, tiles in entries.items()))


def nearest(table: tuple[tuple[int, MoeTiles], ...], tokens: int) -> MoeTiles:
    """The entry recorded at the token count nearest `tokens` (the smaller count on a tie)."""
    return min(table, key=lambda entry: (abs(entry[0] - tokens), entry[0]))[1]


def select_tiles(tokens: int, top_k: int, num_experts: int, inter: int, device: torch.device) -> MoeTiles:
    """The tiles a batch of `tokens` runs with on `device`: the recorded table's nearest entry, else the
    heuristic."""
    if device.type == "cuda":
        table = load_table(num_experts, inter, torch.cuda.get_device_name(device))
        if table:
            return nearest(table, tokens)
    return moe_tiles(tokens * top_k, num_experts)
