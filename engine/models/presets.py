"""Named architecture presets for `--load-format dummy` (random weights, real shapes, no download)."""

from __future__ import annotations

import copy
from typing import Any

# Llama 3.1's shapes beside the width and depth (the 8B and 70B checkpoints share them).
_LLAMA_3_1: dict[str, Any] = dict(
    model_type="llama", vocab_size=128256, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_id=128001, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# The test presets' shared tiny shape: every code path, milliseconds per step.
_TINY: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
)
# Shapes of the public checkpoints; weight values do not change speed.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(_LLAMA_3_1, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32),
    "llama-3.1-70b": dict(_LLAMA_3_1, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    ),
    # SmolLM2-135M-Instruct's shapes (the real model is `smollm2`): CPU timings where its weights cannot travel.
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # Qwen3-30B-A3B's and Mixtral-8x7B-v0.1's config.json shapes (mixture-of-experts, engine/models/moe.py)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "tiny-llama": dict(_TINY, model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny-qwen2": dict(_TINY, model_type="qwen2", rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny-qwen3": dict(_TINY, model_type="qwen3", head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # MoE: 8 experts, 2 per token; Qwen3-MoE's middle layer is dense (mlp_only_layers) to cover both kinds;
    # Qwen2-MoE's shared expert is wider than the routed ones (as in Qwen1.5-MoE)
    "tiny-qwen3-moe": dict(_TINY, model_type="qwen3_moe", num_hidden_layers=3, head_dim=32, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny-qwen2-moe": dict(_TINY, model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                           decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, rms_norm_eps=1e-6,
                           tie_word_embeddings=False),
    "tiny-mixtral": dict(_TINY, model_type="mixtral", intermediate_size=32, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
PRESETS["tiny"] = PRESETS["tiny-llama"]


def preset_hf_config(name: str) -> Any:
    """An HF `PretrainedConfig` for a preset name."""
    from transformers import AutoConfig

    params = copy.deepcopy(PRESETS[name])  # transformers may rewrite nested dicts (rope_scaling) in place
    model_type = params.pop("model_type")
    return AutoConfig.for_model(model_type, **params)
