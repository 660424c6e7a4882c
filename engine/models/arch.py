"""A model's architecture shape, read once from its HF config (engine/models/loader.py `arch_from_hf_config`).

Plain data with no torch and no model code: `engine/config.py` (which the router and the CLI import) names it in
`ModelConfig`, and the runner, the KV sizing and the tensor-parallel layout read it. `architecture` is the HF
`architectures` name the model runs as, the key of engine/models/registry.py.

A mixture-of-experts model carries `moe` (`MoEArch`); its dense layers, if any, use `intermediate_size`, its sparse
layers `moe.expert_intermediate_size` per expert. Dense models have `moe=None`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEArch:
    """The sparse MLP of an MoE model: `num_experts` SwiGLU experts, `top_k` of them per token, picked by a router
    that softmaxes all experts' logits, keeps the top k, and (`renormalize`) rescales those k to sum to one; plus,
    where `shared_expert_intermediate_size` > 0 (Qwen2-MoE), one shared expert every token runs, scaled by a
    sigmoid gate."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # Qwen3-MoE's norm_topk_prob; always true for Mixtral (softmax over the top-k logits)
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is the sparse block; the rest are dense
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def expert_params(self, hidden_size: int) -> int:
        return 3 * hidden_size * self.expert_intermediate_size

    def shared_params(self, hidden_size: int) -> int:
        """The shared expert and its gate (none: 0)."""
        size = self.shared_expert_intermediate_size
        return 3 * hidden_size * size + hidden_size if size else 0


@dataclass(frozen=True)
class ModelArch:
    """Architecture shape read from an HF config; what the model code and KV sizing need."""

    architecture: str  # e.g. "LlamaForCausalLM": picks the model class (engine/models/registry.py)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoEArch | None = None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def num_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        total = self.vocab_size * h + self.num_layers * per_layer + h + head
        if self.moe is not None:  # a sparse layer holds the router and its experts instead of the dense MLP
            sparse = self.moe.num_experts * (self.moe.expert_params(h) + h) + self.moe.shared_params(h) - 3 * h * i
            total += len(self.moe.sparse_layers) * sparse
        return total
