"""Tiny MoE checkpoints built by HF transformers (Qwen3MoeForCausalLM, MixtralForCausalLM) from the tiny presets'
configs, saved as safetensors (per-expert names, as the hub's checkpoints), and their HF greedy outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.models.presets import preset_hf_config

MAX_TOKENS = 10
PROMPT_LENGTHS = (5, 17, 40)


def save_moe_checkpoint(directory: Path, preset: str, seed: int = 0, **overrides: Any) -> Any:
    """An HF model of `preset`'s config (plus `overrides`) with random weights, saved into `directory`; the model.
    The routers are scaled up so tokens pick experts decisively, and the experts so that their outputs move the
    logits (HF's init draws both near zero)."""
    from transformers import AutoModelForCausalLM

    config = preset_hf_config(preset)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(20.0)
            elif ".experts." in name:
                param.mul_(4.0)
    model.save_pretrained(str(directory))
    return model


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(model: Any, prompt: list[int], generated: list[int]) -> list[float]:
    """HF's log-probability of each generated token, given the prompt and the tokens before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    return logits.gather(1, torch.tensor(generated)[:, None]).flatten().tolist()
