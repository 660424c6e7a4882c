"""MoE models (Qwen3-MoE, Mixtral) against HF transformers on tiny random checkpoints saved as safetensors (fp32):
greedy ids through the default, chunked-prefill and preemption paths, and the sparse block's routing and loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.transfer.contract import plan_slices, tensor_bytes
from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.arch import MoEArch
from engine.models.moe import SparseMoeBlock, route
from kvflow import LLM, SamplingParams
from tests.helpers.moe import MAX_TOKENS, hf_greedy, hf_logprobs, prompts, save_moe_checkpoint
from tests.helpers.oracle import run_to_end

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
# (preset, config overrides): Qwen3-MoE with a dense middle layer and renormalized weights, Qwen3-MoE with
# decoder_sparse_step 2 and raw top-k weights, Mixtral, Qwen2-MoE (q|k|v bias, a gated shared expert)
CASES = {
    "qwen3-moe": ("tiny-qwen3-moe", {}),
    "qwen3-moe-step2-raw": ("tiny-qwen3-moe", {"decoder_sparse_step": 2, "mlp_only_layers": [],
                                               "norm_topk_prob": False}),
    "mixtral": ("tiny-mixtral", {}),
    "qwen2-moe-shared": ("tiny-qwen2-moe", {}),
}


@dataclass(frozen=True)
class Case:
    path: Path  # the saved checkpoint
    hf: Any  # the HF model it was saved from
    prompts: list[list[int]]
    expected: list[list[int]]  # HF's greedy continuations of the prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    built = {}
    for name, (preset, overrides) in CASES.items():
        directory = tmp_path_factory.mktemp(name)
        hf = save_moe_checkpoint(directory, preset, **overrides)
        ids = prompts(hf.config.vocab_size)
        built[name] = Case(directory, hf, ids, [hf_greedy(hf, p) for p in ids])
    return built


def generate(path: Path, ids: list[list[int]], **engine_args: Any) -> tuple[LLM, list[list[int]]]:
    llm, outputs = generate_outputs(path, ids, **engine_args)
    return llm, [o.outputs[0].token_ids for o in outputs]


def generate_outputs(path: Path, ids: list[list[int]], **engine_args: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(str(path), dtype="float32", **{"kv_cache_memory_bytes": 8 << 20, "max_model_len": 256, **engine_args})
    return llm, llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(checkpoints, case: str) -> None:  # noqa: ANN001
    case_ = checkpoints[case]
    llm, outputs = generate_outputs(case_.path, case_.prompts)
    assert [o.outputs[0].token_ids for o in outputs] == case_.expected
    for prompt, output in zip(case_.prompts, outputs, strict=True):  # the sampled token's logprob, every step
        ours = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids,
                                                              strict=True)]
        assert ours == pytest.approx(hf_logprobs(case_.hf, prompt, output.outputs[0].token_ids), abs=1e-4)
    moe = llm.llm_engine.config.model.arch.moe
    layers = llm.llm_engine.runner.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)] == list(moe.sparse_layers)


@pytest.mark.parametrize("case", ["qwen3-moe", "mixtral"])
def test_chunked_prefill_matches_transformers(checkpoints, case: str) -> None:  # noqa: ANN001
    case_ = checkpoints[case]
    llm, got = generate(case_.path, case_.prompts, max_num_batched_tokens=8, enable_chunked_prefill=True)
    assert got == case_.expected
    assert llm.stats.num_steps > MAX_TOKENS + 40 // 8  # the 40-token prompt really was split


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_transformers(checkpoints, mode: str) -> None:  # noqa: ANN001
    case = checkpoints["qwen3-moe"]
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, case.hf.config.vocab_size, (12,), generator=gen).tolist() for _ in range(6)]
    # 6 usable blocks of 16 tokens: the six sequences start in one block each and all need a second (12 + 10)
    llm, got = generate(case.path, ids, num_gpu_blocks_override=7, kv_cache_memory_bytes=None, max_model_len=64,
                        preemption_mode=mode, swap_space=0.01)
    assert got == [hf_greedy(case.hf, p) for p in ids]
    assert llm.stats.num_preemptions > 0


def _hf_router(preset: str, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from engine.models.presets import preset_hf_config

    config = preset_hf_config(preset)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config).model.layers[0].mlp.gate


@pytest.mark.parametrize("preset,overrides", [("tiny-qwen3-moe", {"norm_topk_prob": True}),
                                              ("tiny-qwen3-moe", {"norm_topk_prob": False}),
                                              ("tiny-mixtral", {})])
def test_route_is_transformers_router(preset: str, overrides: dict[str, Any]) -> None:
    router = _hf_router(preset, **overrides)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        x = torch.randn(33, router.weight.shape[1])
        _, hf_weights, hf_ids = router(x)
        renormalize = overrides.get("norm_topk_prob", True)
        weights, ids = route(torch.nn.functional.linear(x, router.weight), router.top_k, renormalize, x.dtype)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights.to(x.dtype))
    assert torch.allclose(weights.sum(-1), torch.ones(33)) == renormalize


def test_sparse_block_runs_only_routed_experts() -> None:
    moe = MoEArch(num_experts=4, top_k=1, expert_intermediate_size=8, renormalize=False, sparse_layers=(0,))
    block = SparseMoeBlock(16, moe)
    x = torch.randn(6, 16)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[1, 0] = 1.0  # every token with x[:, 0] > 0 prefers expert 1, the rest experts 0, 2, 3 tie
        x[:, 0] = 5.0
        for p in block.experts["3"].parameters():
            p.fill_(float("nan"))  # an idle expert must not run: NaN would reach the output
        out = block(x)
        weights, ids = route(block.gate(x), 1, False, x.dtype)
        expected = block.experts["1"](x) * weights
    assert ids.flatten().tolist() == [1] * 6
    assert torch.equal(out, expected)


def test_sparse_block_dense_path_equals_loop() -> None:
    moe = MoEArch(num_experts=6, top_k=2, expert_intermediate_size=8, renormalize=True, sparse_layers=(0,))
    block = SparseMoeBlock(16, moe)
    x = torch.randn(9, 16)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)
        weights, ids = route(block.gate(x), 2, True, x.dtype)
        torch.testing.assert_close(block._all_experts(x, weights, ids), block._routed_experts(x, weights, ids))


def test_moe_refusals(checkpoints) -> None:  # noqa: ANN001
    model = EngineArgs(model="tiny-mixtral", device="cpu").create_engine_config().model
    with pytest.raises(ValueError, match="quantization='awq' with an MoE model"):
        EngineArgs(model="tiny-mixtral")._validate_moe(dataclasses.replace(model, quantization="awq"))
    with pytest.raises(ValueError, match="cpu-offload-gb with an MoE model"):  # CUDA only: checked here directly
        EngineArgs(model="tiny-mixtral", cpu_offload_gb=1.0)._validate_moe(model)


def test_pd_transfer_matches_transformers(checkpoints) -> None:  # noqa: ANN001
    """Prefill on one engine, the KV exported through its `KVPort` and imported into another, decode there: HF's
    greedy ids (the KV layout of an MoE model is its attention's, unchanged)."""
    case = checkpoints["mixtral"]
    args = dict(model=str(case.path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    prefill = LLMEngine(EngineArgs(**args, max_num_batched_tokens=16).create_engine_config())  # type: ignore[arg-type]
    decode = LLMEngine(EngineArgs(**args).create_engine_config())  # type: ignore[arg-type]
    params = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (prompt, expected) in enumerate(zip(case.prompts, case.expected, strict=True)):
        rid = f"pd-{i}"
        slot = decode.add_remote_prefill_request(rid, prompt, SamplingParams(**params))
        assert slot is not None
        prefill.add_request(rid, prompt, SamplingParams(**{**params, "max_tokens": 1}), kv_lease_s=10)
        first = run_to_end(prefill, rid)[0]
        held = prefill.kv_block_ids(rid)
        skip = slot.num_cached_blocks
        for part in plan_slices(skip, len(held) - skip, prefill.kv_port.layout, max_bytes=4096):
            export = prefill.kv_port.export(held[part.first_block : part.first_block + part.num_blocks], part)
            ids = slot.block_ids[part.first_block : part.first_block + part.num_blocks]
            wire = decode.kv_port.wire_from_bytes(part, tensor_bytes(export.tensor))
            assert decode.kv_port.import_(ids, part, wire).wait()
        prefill.release_kv(rid)
        prompt_tokens = decode.stats.prompt_tokens
        decode.finish_remote_prefill(rid, first, None, prefill.sampler_state(rid))
        assert run_to_end(decode, rid) == expected
        assert decode.stats.prompt_tokens == prompt_tokens, "the decode side computed no prompt token"


def test_expert_load_histogram(checkpoints) -> None:  # noqa: ANN001
    """Every step observes each (sparse layer, expert)'s routed tokens; all observations sum to every token the
    model ran times top-k times the sparse layers, and /metrics exports the histogram."""
    from prometheus_client import generate_latest

    from engine.metrics.prometheus import EngineMetrics

    case = checkpoints["qwen3-moe"]
    llm, got = generate(case.path, case.prompts)
    stats = llm.stats
    moe = llm.llm_engine.config.model.arch.moe
    forwarded = sum(map(len, case.prompts)) + len(case.prompts) * (MAX_TOKENS - 1)  # the last token is never fed
    assert stats.moe_expert_tokens_sum == forwarded * moe.top_k * len(moe.sparse_layers)
    assert stats.moe_expert_tokens_buckets[-1] == stats.num_steps * moe.num_experts * len(moe.sparse_layers)
    assert stats.moe_expert_tokens_buckets == sorted(stats.moe_expert_tokens_buckets)  # cumulative
    metrics = EngineMetrics("m")
    metrics.update(stats, [])
    text = generate_latest(metrics.registry).decode()
    assert f'kvflow:moe_expert_tokens_bucket{{le="+Inf",model_name="m"}} {stats.num_steps * 16}.0' in text
    assert f'kvflow:moe_expert_tokens_sum{{model_name="m"}} {stats.moe_expert_tokens_sum}.0' in text
    assert "kvflow:moe_expert_tokens" not in generate_latest(EngineMetrics("dense").registry).decode()
