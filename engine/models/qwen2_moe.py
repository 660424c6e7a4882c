"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 decoder (q|k|v bias) with the sparse block
(engine/models/moe.py) on the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse, and in each sparse
block one shared expert that every token runs, scaled by `sigmoid(shared_expert_gate(x))` and added to the routed
experts' sum; the router renormalizes the top-k weights only when `norm_topk_prob`.

Checkpoint names: Qwen3-MoE's (`mlp.gate`, `mlp.experts.{e}.gate_proj|up_proj|down_proj`) plus
`mlp.shared_expert.gate_proj|up_proj|down_proj` and `mlp.shared_expert_gate`. Under tensor parallelism the shared
expert is sliced like a dense MLP over its own intermediate rows (with or without expert parallelism); its gate
is replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from engine.models.moe import MoECausalLM
from engine.models.weight_map import TPSplit, column_parallel, row_parallel


class Qwen2MoeForCausalLM(MoECausalLM):
    tp_plan: ClassVar[Mapping[str, TPSplit]] = {
        **MoECausalLM.tp_plan,
        "shared_expert.gate_proj": column_parallel("shared_expert_intermediate"),
        "shared_expert.up_proj": column_parallel("shared_expert_intermediate"),
        "shared_expert.down_proj": row_parallel("shared_expert_intermediate"),
    }
