"""Expert parallelism on CPU (gloo, fp32): with `enable_expert_parallel` and TP=2 each rank holds half the experts
whole (attention and dense MLPs tensor-parallel), and greedy ids equal TP=1's and HF transformers' on a tiny
Qwen3-MoE checkpoint and on the dummy tiny-mixtral preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.loader import resolve_model
from engine.models.weight_map import expert_index
from engine.parallel.layout import shard_for
from engine.parallel.sharding import load_sharded_state
from kvflow import LLM, SamplingParams
from tests.helpers.moe import MAX_TOKENS, hf_greedy, prompts, save_moe_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)


def _ids(llm: LLM, ids: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = tmp_path_factory.mktemp("qwen3-moe-ep")
    hf = save_moe_checkpoint(path, "tiny-qwen3-moe")
    ids = prompts(hf.config.vocab_size)
    return path, ids, [hf_greedy(hf, p) for p in ids]


def test_each_rank_reads_only_its_experts(qwen3_moe) -> None:  # noqa: ANN001
    path = str(qwen3_moe[0])
    arch = resolve_model(path).arch
    shards = [shard_for(arch, rank, 2, expert_parallel=True) for rank in range(2)]
    assert [s.experts for s in shards] == [(0, 4), (4, 8)]
    states = [load_sharded_state(path, arch, s) for s in shards]
    for shard, state in zip(shards, states, strict=True):
        experts = {expert_index(key) for key in state} - {None}
        assert experts == set(range(*shard.experts))
        gate = state["model.layers.0.mlp.experts.5.gate_proj.weight"] if 5 in experts else None
        assert gate is None or gate.shape == (32, 64)  # whole, not sliced
    # the router is replicated, the dense layer's MLP split by intermediate rows
    assert torch.equal(states[0]["model.layers.0.mlp.gate.weight"], states[1]["model.layers.0.mlp.gate.weight"])
    assert states[0]["model.layers.1.mlp.gate_proj.weight"].shape == (64, 64)


def test_ep2_matches_ep1_and_transformers(qwen3_moe) -> None:  # noqa: ANN001
    path, ids, expected = qwen3_moe
    assert _ids(LLM(str(path), **ARGS), ids) == expected
    with LLM(str(path), **ARGS, tensor_parallel_size=2, enable_expert_parallel=True) as ep:
        assert _ids(ep, ids) == expected
        layers = ep.llm_engine.runner.model.layers  # rank 0's
        assert list(layers[0].mlp.experts) == ["0", "1", "2", "3"] and list(layers[2].mlp.experts) == ["0", "1", "2", "3"]
        assert layers[1].mlp.down_proj.in_features == 64  # the dense layer's MLP: half of the 128 rows


def test_dummy_ep2_matches_ep1() -> None:
    ids = prompts(512)
    base = _ids(LLM("tiny-mixtral", load_format="dummy", **ARGS), ids)
    with LLM("tiny-mixtral", load_format="dummy", **ARGS, tensor_parallel_size=2, enable_expert_parallel=True) as ep:
        assert _ids(ep, ids) == base


@pytest.mark.parametrize(("model", "kwargs", "message"), [
    ("tiny", {"enable_expert_parallel": True, "tensor_parallel_size": 2}, "a dense model has no experts"),
    ("tiny-mixtral", {"tensor_parallel_size": 2}, "needs --enable-expert-parallel"),
])
def test_expert_parallel_refusals(model: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model, load_format="dummy", **ARGS, **kwargs)
