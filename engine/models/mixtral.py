"""Mixtral (8x7B, 8x22B): the Llama decoder with the sparse block (engine/models/moe.py) in every layer; the
router's top-k weights always sum to one (a softmax over the top-k logits, computed as transformers does).

Checkpoint names: `block_sparse_moe.gate` (the router) and `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up,
down), loaded into the shared block's `mlp.gate` and `mlp.experts.{e}.gate_up_proj|down_proj`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from engine.models.moe import MoECausalLM
from engine.models.weight_map import TPSplit, column_parallel, row_parallel


class MixtralForCausalLM(MoECausalLM):
    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0),
    }
    expert_tp_plan: ClassVar[Mapping[str, TPSplit]] = {
        "w1": column_parallel("expert_intermediate"), "w3": column_parallel("expert_intermediate"),
        "w2": row_parallel("expert_intermediate"),
    }
    checkpoint_renames: ClassVar[Mapping[str, str]] = {"mlp": "block_sparse_moe"}
