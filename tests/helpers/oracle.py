"""Shared pieces of the engine tests: the real SmolLM2 model, its HF oracle, prompts and comparisons."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from engine.models.loader import resolve_model
from engine.models.presets import preset_hf_config

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from kvflow import RequestOutput

# Varied prompts: chat-ish, code, lists, numbers, unicode, a long-ish one.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of three fruits:",
    "In 1969, the first humans",
    "Translate to French: Good morning, my friend.",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "Les élèves ont étudié la révolution française et",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
    "1, 2, 3, 4, 5,",
    "Water boils at",
]

SMALL_KV = 256 << 20


@functools.cache
def smollm2_path() -> str:
    resolved = resolve_model("smollm2")
    assert resolved.path is not None
    return resolved.path


@functools.cache
def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    return model.eval()


@functools.cache
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=2,
                             eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def hf_next_logprobs(token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model()(torch.tensor([token_ids])).logits[0, -1].float()
    return logits.log_softmax(-1)


def assert_matches_oracle(prompt_ids: list[int], ours: list[int], theirs: list[int], tol: float = 1e-2) -> None:
    """Exact match, or a first divergence at a near-tie: our token is the oracle's second choice within `tol`
    nats of its first."""
    if ours == theirs:
        return
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    logprobs = hf_next_logprobs(prompt_ids + theirs[:k])
    top2 = logprobs.topk(2)
    assert top2.indices[0].item() == theirs[k], "oracle's own choice must be its argmax"
    assert top2.indices[1].item() == ours[k], f"divergence at {k}: ours {ours[k]} is not the oracle's 2nd choice"
    gap = (top2.values[0] - top2.values[1]).item()
    assert gap <= tol, f"divergence at {k} is not a near-tie: gap {gap:.4f} nats"


def count_exact_else_top5(expected: list[RequestOutput], got: list[RequestOutput]) -> int:
    """How many of `got` equal `expected` (greedy, run with logprobs=5) token for token. Every other one must
    first leave its expected ids for a token in the top-5 of that step."""
    exact = 0
    for want, have in zip(expected, got, strict=True):
        ours, theirs = have.outputs[0].token_ids, want.outputs[0].token_ids
        if ours == theirs:
            exact += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
        top5 = want.outputs[0].logprobs[k]
        assert ours[k] in top5 and top5[ours[k]].rank <= 5, f"divergence at {k}: {ours[k]} not in the top-5"
    return exact


def run_to_end(engine: LLMEngine, request_id: str) -> list[int]:
    """Step `engine` until `request_id` finishes; its token ids."""
    for _ in range(10_000):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.outputs[0].token_ids
    raise AssertionError("request never finished")


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> list[Any]:
    """Each prompt's completion (`CompletionOutput`, with logprobs=1), greedy and `max_tokens` long, all stepped
    together on `engine`; every reported logprob is finite."""
    from engine.sampling_params import SamplingParams

    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1,
                                                            ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    outs = [done[f"r{n}"] for n in range(len(prompts))]
    for out in outs:
        assert all(math.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids, strict=True))
    return outs


def tiny_hf_state(arch, gen: torch.Generator) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Random HF-named weights of a Llama-shaped `arch` (the `tiny` preset's, say)."""
    h, q, kv, i = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    state = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, h, generator=gen) * 0.02,
             "model.norm.weight": torch.ones(h), "lm_head.weight": torch.randn(arch.vocab_size, h, generator=gen) * 0.02}
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        for name, shape in shapes.items():
            state[p + name + ".weight"] = torch.randn(*shape, generator=gen) * 0.05
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return state


def write_tiny_checkpoint(tmp: Path, quantization_config: dict | None, state: dict[str, torch.Tensor]) -> Path:
    """A model directory of the `tiny` preset's config.json (plus `quantization_config`) and `state`."""
    cfg = preset_hf_config("tiny").to_dict()
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    return tmp
