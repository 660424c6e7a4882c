"""Tensor parallelism on CPU (gloo, fp32): TP=2 gives TP=1's greedy ids on the tiny Llama / Qwen2 / Qwen3 presets
and on SmolLM2 (9 heads, 3 KV heads: uneven GQA split), sharded loading reassembles the full checkpoint, the step
codec round-trips, ep for a dense model is refused, and a killed rank makes the engine raise instead of hanging."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.models.loader import hf_state_dict, resolve_model
from engine.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.parallel import codec
from engine.parallel.executor import TensorParallelError
from engine.parallel.layout import shard_for
from engine.parallel.sharding import load_sharded_state
from engine.sampling_params import SamplingParams
from kvflow import LLM
from kvflow.commands.serve import role_tensor_parallel, worker_counts
from kvflow.launcher import ClusterSpec, WorkerCluster, place_workers
from tests.helpers import parallel
from tests.helpers.parallel import GREEDY, PROMPTS, token_ids


# ---- layout ----------------------------------------------------------------------------------------------------
def test_smollm2_uneven_split_deals_out_whole_gqa_groups() -> None:
    arch = resolve_model("smollm2").arch
    assert (arch.num_heads, arch.num_kv_heads) == (9, 3)
    r0, r1 = shard_for(arch, 0, 2), shard_for(arch, 1, 2)
    assert (r0.q_heads, r0.kv_heads, r1.q_heads, r1.kv_heads) == ((0, 6), (0, 1), (6, 9), (2,))
    assert r0.intermediate[1] == r1.intermediate[0] and r1.intermediate[1] == arch.intermediate_size
    assert r0.vocab == (0, arch.vocab_size // 2) and r1.vocab[1] == arch.vocab_size


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    arch = resolve_model("tiny", "dummy").arch  # 4 heads, 2 KV heads
    shards = [shard_for(arch, r, 4) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0,), (0,), (1,), (1,)]
    smol = resolve_model("smollm2").arch  # 9 heads, 3 KV heads at TP=4: rank 2 reads KV heads 1 and 2
    mixed = shard_for(smol, 2, 4)
    assert mixed.q_heads == (5, 7) and mixed.kv_heads == (1, 2)
    for rank in range(4):
        s = shard_for(smol, rank, 4)
        assert s.num_heads % s.num_kv_heads == 0
        group = s.num_heads // s.num_kv_heads
        for j, head in enumerate(range(*s.q_heads)):  # each local q head reads its own global KV head
            assert s.kv_heads[j // group] == head // 3
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        shard_for(arch, 0, 5)


def test_sharded_loading_reassembles_the_full_checkpoint() -> None:
    resolved = resolve_model("smollm2")
    arch, path = resolved.arch, resolved.path
    assert path is not None
    full = hf_state_dict(path)
    shards = [load_sharded_state(path, arch, shard_for(arch, r, 2)) for r in range(2)]
    assert set(shards[0]) == set(full)
    for key, tensor in full.items():
        parts = [s[key] for s in shards]
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            kv = [shard_for(arch, r, 2).kv_heads for r in range(2)]
            heads = {h: p[i * arch.head_dim:(i + 1) * arch.head_dim] for p, ks in zip(parts, kv, strict=True)
                     for i, h in enumerate(ks)}
            rebuilt = torch.cat([heads[h] for h in range(arch.num_kv_heads)])
        elif key.endswith(("o_proj.weight", "down_proj.weight")):
            rebuilt = torch.cat(parts, dim=1)
        elif key.endswith("norm.weight"):
            assert all(torch.equal(p, tensor) for p in parts)
            continue
        else:
            rebuilt = torch.cat(parts, dim=0)
        assert parts[0].numel() < tensor.numel(), key  # each rank read only its slice
        assert torch.equal(rebuilt, tensor), key


def test_step_codec_sends_block_tables_as_deltas_and_rebuilds_them() -> None:
    """A StepEncoder / StepDecoder pair over a run of steps: every chunk's whole table comes back, a growing table
    costs only its new blocks, a changed one (preempted, recomputed) and a reused id after a finish come back
    whole, and a frame read out of order is refused."""
    encoder, decoder = codec.StepEncoder(), codec.StepDecoder()

    def step(tables: dict[str, list[int]], finished: set[str] = frozenset()) -> tuple[SchedulerOutput, bytes]:
        chunks = [ScheduledChunk(rid, [9], 40, table, True, False) for rid, table in tables.items()]
        so = SchedulerOutput([], chunks, len(chunks), finished_request_ids=set(finished), num_decode_seqs=len(chunks))
        return so, encoder.encode(so)

    growing = list(range(100, 140))
    first, frame = step({"a": growing, "b": [7, 8]})
    assert decoder.decode(frame).chunks == first.chunks
    growing.append(141)  # the scheduler's live list grows in place: the encoder kept a copy
    second, frame = step({"a": growing, "b": [7, 8]})
    assert decoder.decode(frame).chunks == second.chunks
    assert len(codec.encode(second)) - len(frame) >= 40 * 3  # the 40 known blocks of a (3-digit ids) not sent
    third, frame = step({"a": [5, 6], "b": [7, 8, 9]})  # a's table replaced (recompute): sent whole
    assert decoder.decode(frame).chunks == third.chunks
    fourth, frame = step({"b": [1]}, finished={"b"})  # b finished, and a new request reuses its id
    back = decoder.decode(frame)
    assert back.chunks == fourth.chunks and back.finished_request_ids == {"b"}
    stale = codec.StepDecoder()  # a decoder that missed the frames before
    _, frame = step({"a": [5, 6, 10]})
    with pytest.raises(ValueError, match="out of order"):
        stale.decode(frame)


def test_step_codec_round_trips_without_pickle() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, logit_bias={7: 2.5}, stop=["x"], logprobs=2,
                            max_tokens=9)
    so = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], params, [4], b"\x00\xffstate")],
        chunks=[ScheduledChunk("a", [3], 2, [5, 6], True, False), ScheduledChunk("b", [1, 2], 0, [7], False, True)],
        total_num_scheduled_tokens=3, blocks_to_swap_out=[(1, 2)], blocks_to_swap_in=[(3, 4)],
        finished_request_ids={"z"}, num_decode_seqs=1, num_prefill_tokens=2, prefill_attention_pairs=3,
        prefill_token_cap=16)
    back = codec.decode(codec.encode(so))
    assert back.chunks == so.chunks and back.finished_request_ids == so.finished_request_ids
    assert (back.num_decode_seqs, back.num_prefill_tokens, back.prefill_attention_pairs, back.prefill_token_cap) \
        == (1, 2, 3, 16)
    assert back.blocks_to_swap_in == so.blocks_to_swap_in and back.blocks_to_swap_out == so.blocks_to_swap_out
    new = back.new_requests[0]
    assert (new.request_id, new.prompt_token_ids, new.output_token_ids, new.generator_state) == \
        ("a", [1, 2, 3], [4], b"\x00\xffstate")
    assert new.sampling_params == params and new.sampling_params.logit_bias == {7: 2.5}


# ---- TP=2 against TP=1 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tp2() -> Iterator[LLM]:
    """One TP=2 tiny-Llama engine for the module (its rank is killed by the last test)."""
    yield from parallel.tiny_engine(tensor_parallel_size=2)


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_tiny_presets_tp2_match_tp1(model: str, tiny_tp2: LLM) -> None:
    parallel.assert_matches_one_rank(model, tiny_tp2, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def smollm2_tp2() -> Iterator[LLM]:
    llm = LLM("smollm2", kv_cache_memory_bytes=1 << 26, max_model_len=512, tensor_parallel_size=2)
    yield llm
    llm.close()


def test_smollm2_tp2_matches_tp1_greedy_logprobs_and_seeded_sampling(smollm2_tp2: LLM) -> None:
    base = LLM("smollm2", kv_cache_memory_bytes=1 << 26, max_model_len=512)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    ours, theirs = smollm2_tp2.chat(messages, greedy)[0].outputs[0], base.chat(messages, greedy)[0].outputs[0]
    assert ours.text == "The capital of France is Paris."
    assert ours.token_ids == theirs.token_ids
    assert ours.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 140))]
    assert token_ids(smollm2_tp2, prompts, seeded) == token_ids(base, prompts, seeded)


def test_kvflow_generate_runs_with_tensor_parallel_size_2_on_cpu() -> None:
    done = subprocess.run([sys.executable, "-m", "kvflow.cli", "--log-level", "WARNING", "generate", "--model",
                           "smollm2", "--tensor-parallel-size", "2", "--chat", "--max-tokens", "10",
                           "--kv-cache-memory-bytes", str(1 << 26), "--max-model-len", "512",
                           "What is the capital of France?"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "The capital of France is Paris." in done.stdout


def test_worker_info_reports_the_parallel_layout(tiny_tp2: LLM) -> None:
    parallel.assert_worker_reports(tiny_tp2, tensor_parallel_size=2, pipeline_parallel_size=1)


# ---- failures and refusals -------------------------------------------------------------------------------------
def test_a_killed_rank_makes_the_engine_raise_not_hang(tiny_tp2: LLM) -> None:
    """Last user of `tiny_tp2`: kills its rank 1."""
    llm = tiny_tp2
    assert token_ids(llm, PROMPTS[:1], GREEDY)  # healthy first
    started = parallel.kill_rank_1(llm)
    with pytest.raises(TensorParallelError):
        llm.llm_engine.check_ranks()  # what a worker's health probe calls: NOT_SERVING
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"enable_expert_parallel": True}, "enable_expert_parallel is not supported"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ({"tensor_parallel_size": 5}, "exceeds the model's 4 attention heads"),
])
def test_unsupported_parallel_layouts_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="tiny", load_format="dummy", **kwargs).create_engine_config()


def test_serve_worker_counts_for_data_and_tensor_parallelism() -> None:
    assert worker_counts(None, None, None) == (1, 1)  # tensor-parallel workers disaggregate too
    assert worker_counts(None, None, 3) == (0, 3)
    with pytest.raises(ValueError, match="drop --decode-workers"):
        worker_counts(None, 2, 3)
    with pytest.raises(ValueError, match="--data-parallel-size must be >= 1"):
        worker_counts(None, None, 0)
    assert role_tensor_parallel(2, None, None) == (2, 2)  # --tensor-parallel-size applies to both roles
    assert role_tensor_parallel(2, 1, None) == (1, 2) and role_tensor_parallel(1, None, 4) == (1, 4)
    with pytest.raises(ValueError, match="--decode-tensor-parallel-size must be >= 1"):
        role_tensor_parallel(1, None, 0)


def test_serve_places_each_workers_ranks_on_consecutive_gpus() -> None:
    args = EngineArgs(model="tiny", load_format="dummy", tensor_parallel_size=2)
    placed = place_workers(ClusterSpec(args, 0, 2), 4)
    assert [(p.gpu, sorted(p.gpus), p.gpu_memory_utilization) for p in placed] == [(0, [0, 1], 0.9),
                                                                                   (2, [2, 3], 0.9)]
    shared = place_workers(ClusterSpec(args, 0, 2), 2)  # both replicas on GPUs 0-1: the share splits
    assert [(p.gpu, p.gpu_memory_utilization) for p in shared] == [(0, 0.45), (0, 0.45)]
    with pytest.raises(ValueError, match="needs 2 GPUs per worker"):
        place_workers(ClusterSpec(args, 0, 1), 1)
    with pytest.raises(ValueError, match="consecutive GPUs"):
        place_workers(ClusterSpec(args, 0, 1, decode_gpus=(1,)), 2)


def test_serve_places_each_roles_ranks_by_its_own_tensor_parallel_size() -> None:
    args = EngineArgs(model="tiny", load_format="dummy")
    spec = ClusterSpec(args, 1, 1, prefill_tensor_parallel_size=2, decode_tensor_parallel_size=1)
    placed = place_workers(spec, 3)  # prefill on GPUs 0-1, decode on GPU 2
    assert [(p.role, sorted(p.gpus), p.tensor_parallel_size, p.gpu_memory_utilization) for p in placed] == \
        [("prefill", [0, 1], 2, 0.9), ("decode", [2], 1, 0.9)]
    shared = place_workers(dataclasses.replace(spec, decode_tensor_parallel_size=2), 2)  # both on GPUs 0-1
    assert [(p.gpu, p.tensor_parallel_size, p.gpu_memory_utilization) for p in shared] == [(0, 2, 0.45),
                                                                                         (0, 2, 0.45)]
    with pytest.raises(ValueError, match=r"needs 4 GPUs per worker, but 2 are visible \(decode workers\)"):
        place_workers(dataclasses.replace(spec, decode_tensor_parallel_size=4), 2)
    cluster = WorkerCluster(spec)
    argv = cluster.worker_argv(0, placed[0], 1234)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in cluster.worker_argv(1, placed[1], 1235)  # the default, 1


def test_a_worker_whose_rank_died_turns_not_serving_and_stops() -> None:
    import asyncio

    from cluster.worker.runtime import _watch_ranks

    class DeadRanks:
        def check_ranks(self) -> None:
            raise TensorParallelError("tensor-parallel rank 1 exited with code -9")

    class Health:
        draining = False

    async def scenario() -> tuple[bool, bool, list[BaseException]]:
        health, stop, failure = Health(), asyncio.Event(), []
        await asyncio.wait_for(_watch_ranks(DeadRanks(), health, stop, failure), 5)  # type: ignore[arg-type]
        return health.draining, stop.is_set(), failure

    draining, stopped, failure = asyncio.run(scenario())
    assert draining and stopped and "rank 1" in str(failure[0])


def test_nccl_all_gather_layout_joins_columns_like_cat() -> None:
    """NCCL's all-gather stacks ranks along a new first dim; the logits need them side by side on the last."""
    from engine.parallel.group import join_gathered

    parts = [torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * r for r in range(3)]
    torch.testing.assert_close(join_gathered(torch.stack(parts)), torch.cat(parts, dim=-1))


def test_nccl_binding_refuses_what_it_cannot_send() -> None:
    from engine.parallel.nccl import NCCL_UNIQUE_ID_BYTES, _nccl_dtype, nccl_library_path

    assert _nccl_dtype(torch.zeros(2, dtype=torch.bfloat16)) == 9
    with pytest.raises(ValueError, match="contiguous"):
        _nccl_dtype(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="complex64"):
        _nccl_dtype(torch.zeros(2, dtype=torch.complex64))
    assert NCCL_UNIQUE_ID_BYTES == 128
    assert nccl_library_path()  # the override, torch's mapped libnccl, or the loader's name
