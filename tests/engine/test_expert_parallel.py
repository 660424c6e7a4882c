"""MoE models over two ranks on CPU (gloo, fp32): with `enable_expert_parallel` each rank holds half the experts
whole, without it every expert sliced by intermediate rows (attention and dense MLPs tensor-parallel either way);
greedy ids equal one rank's and HF transformers' on a tiny Qwen3-MoE checkpoint and on the dummy tiny-mixtral
preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.models.loader import resolve_model
from engine.models.presets import preset_hf_config
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


def test_each_rank_reads_its_rows_of_every_expert_without_ep(qwen3_moe) -> None:  # noqa: ANN001
    path = str(qwen3_moe[0])
    arch = resolve_model(path).arch
    full = load_sharded_state(path, arch, shard_for(arch, 0, 1))
    halves = [load_sharded_state(path, arch, shard_for(arch, rank, 2)) for rank in range(2)]
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        key = f"model.layers.2.mlp.experts.7.{name}.weight"
        assert torch.equal(torch.cat([h[key] for h in halves], dim=dim), full[key])
        assert halves[0][key].shape[dim] == 16


def test_tp2_slicing_experts_matches_transformers(qwen3_moe) -> None:  # noqa: ANN001
    path, ids, expected = qwen3_moe
    with LLM(str(path), **ARGS, tensor_parallel_size=2) as tp:
        assert _ids(tp, ids) == expected
        expert = tp.llm_engine.runner.model.layers[0].mlp.experts["7"]  # rank 0's: every expert, half its rows
        assert len(tp.llm_engine.runner.model.layers[0].mlp.experts) == 8 and expert.down_proj.in_features == 16


def test_ep2_matches_ep1_and_transformers(qwen3_moe) -> None:  # noqa: ANN001
    path, ids, expected = qwen3_moe
    assert _ids(LLM(str(path), **ARGS), ids) == expected
    with LLM(str(path), **ARGS, tensor_parallel_size=2, enable_expert_parallel=True) as ep:
        assert _ids(ep, ids) == expected
        layers = ep.llm_engine.runner.model.layers  # rank 0's
        assert list(layers[0].mlp.experts) == ["0", "1", "2", "3"] and list(layers[2].mlp.experts) == ["0", "1", "2", "3"]
        assert layers[1].mlp.down_proj.in_features == 64  # the dense layer's MLP: half of the 128 rows


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_qwen2_moe_shared_expert_over_two_ranks_matches_transformers(tmp_path: Path, expert_parallel: bool) -> None:
    """The shared expert is sliced by its rows on both layouts; its gate is replicated."""
    hf = save_moe_checkpoint(tmp_path, "tiny-qwen2-moe")
    ids = prompts(hf.config.vocab_size)[:2]
    with LLM(str(tmp_path), **ARGS, tensor_parallel_size=2, enable_expert_parallel=expert_parallel) as two:
        assert _ids(two, ids) == [hf_greedy(hf, p) for p in ids]
        block = two.llm_engine.runner.model.layers[0].mlp
        assert block.shared_expert.down_proj.in_features == 24 and block.shared_expert_gate.out_features == 1


def test_dummy_ep2_and_tp2_match_one_rank() -> None:
    ids = prompts(512)
    base = _ids(LLM("tiny-mixtral", load_format="dummy", **ARGS), ids)
    for expert_parallel in (True, False):
        with LLM("tiny-mixtral", load_format="dummy", **ARGS, tensor_parallel_size=2,
                 enable_expert_parallel=expert_parallel) as two:
            assert _ids(two, ids) == base


@pytest.mark.parametrize(("preset", "config", "kwargs", "message"), [
    ("tiny-mixtral", {}, {"enable_expert_parallel": True, "model": "tiny"}, "a dense model has no experts"),
    ("tiny-mixtral", {"num_local_experts": 2, "num_experts_per_tok": 1}, {"enable_expert_parallel": True},
     "needs at least one expert per rank; the model has 2"),
    ("tiny-qwen3-moe", {"moe_intermediate_size": 3}, {}, "slices each expert's 3 intermediate rows too thin"),
])
def test_moe_parallel_refusals(tmp_path: Path, preset: str, config: dict, kwargs: dict, message: str) -> None:
    hf_config = preset_hf_config(preset).to_dict() | config
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    args = {"model": str(tmp_path), "tensor_parallel_size": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args, load_format="dummy").create_engine_config()
