"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (q/k norms, no biases) with the sparse block
(engine/models/moe.py) on the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse; the router keeps the
top-k softmax weights as they are unless `norm_topk_prob` renormalizes them. No shared experts.

Checkpoint names: `mlp.gate` (the router), `mlp.experts.{e}.gate_proj|up_proj|down_proj`, and the dense
`mlp.gate_proj|up_proj|down_proj` of the layers without experts: the same leaves as the dense model, so the packing
(gate|up) is `CausalLM`'s.
"""

from __future__ import annotations

from engine.models.moe import MoECausalLM


class Qwen3MoeForCausalLM(MoECausalLM):
    """Weight names as HF's Qwen3MoeForCausalLM checkpoints spell them (the base class's)."""
