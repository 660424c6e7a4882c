"""Each supported architecture matches HF transformers on a random tiny config (fp32): logits and greedy ids."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_tiny_architecture_matches_transformers(preset: str) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(preset, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, seed=3,
              max_num_batched_tokens=24)
    model = llm.llm_engine.runner.model
    hf = AutoModelForCausalLM.from_config(llm.llm_engine.config.model.hf_config, dtype=torch.float32).eval()
    # Same weights: copy ours into HF's (split fused q|k|v and gate|up back).
    state = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        state["lm_head.weight"] = model.lm_head.weight
    arch = model.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for name, part in zip("qkv", attn.qkv_proj.weight.split([q, kv, kv]), strict=True):
            state[p + f"self_attn.{name}_proj.weight"] = part
        if attn.qkv_proj.bias is not None:
            for name, part in zip("qkv", attn.qkv_proj.bias.split([q, kv, kv]), strict=True):
                state[p + f"self_attn.{name}_proj.bias"] = part
        state[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        if attn.q_norm is not None:
            state[p + "self_attn.q_norm.weight"] = attn.q_norm.weight
            state[p + "self_attn.k_norm.weight"] = attn.k_norm.weight
        gate, up = layer.mlp.gate_up_proj.weight.split(arch.intermediate_size)
        state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"] = gate, up
        state[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        state[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        state[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)  # tied heads share the embedding

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        first = out.outputs[0].token_ids[0]
        assert out.outputs[0].logprobs[0][first].logprob == pytest.approx(logits[first].item(), abs=1e-4)
