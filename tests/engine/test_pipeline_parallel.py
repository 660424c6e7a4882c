"""Pipeline parallelism on CPU (gloo, fp32): PP=2 gives PP=1's greedy ids on the tiny presets (untied and tied
embeddings), through chunked prefill, combined with TP=2, and on SmolLM2 (real weights, 3 stages); each stage
holds only its layers; the engine keeps one micro-batch in flight per stage (disjoint requests, collected in order,
never preempted while in flight); bad sizes and unsupported combinations are refused naming the flag; a killed
stage makes the engine raise instead of hanging."""

from __future__ import annotations

import argparse
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.config import SchedulerConfig
from engine.core.block_hash import BlockHasher
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.models.loader import resolve_model
from engine.models.registry import model_class
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.parallel.batch_queue import BatchQueue
from engine.parallel.sharding import held_checkpoint_keys
from engine.parallel.stages import PipelineStage, WorldRank, layer_ranges
from engine.runner.attention import TorchPagedAttention
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputsParams
from kvflow import LLM
from kvflow.commands.serve import pipeline_prefill_workers, worker_counts
from kvflow.launcher import ClusterSpec, place_workers
from tests.helpers import parallel
from tests.helpers.parallel import GREEDY, KV, PROMPTS, token_ids


# ---- layout ----------------------------------------------------------------------------------------------------
def test_layers_split_as_vllm_splits_them() -> None:
    assert layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]  # the remainder before the last stage
    assert layer_ranges(2, 2) == [(0, 1), (1, 2)]
    assert layer_ranges(5, 1) == [(0, 5)]
    # world rank 0 (the engine) is the last stage; tp ranks of a stage are consecutive
    places = [WorldRank(g, 2, 3) for g in range(6)]
    assert [(p.stage, p.tp_rank) for p in places] == [(2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert places[5].peer(1) == 3 and places[3].peer(2) == 1


def test_a_stage_holds_only_its_layers_and_its_end_of_the_model() -> None:
    resolved = resolve_model("tiny-qwen2", "dummy")  # tied embeddings: the last stage keeps the matrix as its head
    arch = resolved.arch
    cls = model_class(arch.architecture)
    first, last = (cls(arch, resolved.hf_config, TorchPagedAttention(16), 64, stage=PipelineStage.of(2, i, 2))
                   for i in range(2))
    real = {name for name, p in first.named_parameters() if not p.is_meta}
    assert real and all(n.startswith(("embed_tokens.", "layers.0.")) for n in real)
    assert all(n.startswith(("embed_tokens.", "layers.1.", "norm.")) for n, p in last.named_parameters()
               if not p.is_meta)
    keys = held_checkpoint_keys(first)
    assert "model.embed_tokens.weight" in keys and not any("layers.1." in k or "model.norm" in k for k in keys)
    # names and order stay the full model's (dummy weights draw the same values on every layout)
    assert [n for n, _ in first.named_parameters()] == [n for n, _ in cls(arch, resolved.hf_config,
                                                                          TorchPagedAttention(16), 64).named_parameters()]


def test_step_codec_carries_structured_outputs() -> None:
    """The other ranks get every step's new requests; a grammar-constrained one used to fail to encode."""
    from engine.outputs import NewRequestData
    from engine.parallel import codec

    constraint = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                         disable_any_whitespace=True)
    params = SamplingParams(max_tokens=4, structured_outputs=constraint)
    so = SchedulerOutput([NewRequestData("a", [1, 2], params, [], b"")], [], 0)
    back = codec.decode(codec.encode(so)).new_requests[0].sampling_params
    assert back.structured_outputs == constraint and back == params


# ---- micro-batches -------------------------------------------------------------------------------------------------
class RecordingRunner:
    """Rank 0's submit/collect, recorded; every sampling chunk samples token 7."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[str, ...]]] = []

    def submit(self, so: SchedulerOutput) -> None:
        self.events.append(("submit", tuple(c.request_id for c in so.chunks)))

    def collect(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.events.append(("collect", tuple(c.request_id for c in so.chunks)))
        return ModelRunnerOutput({c.request_id: 7 for c in so.chunks if c.sample})


def _scheduler(num_blocks: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, BlockHasher.for_model("t", 4), enable_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32), kv, None)


def _request(rid: str, n_prompt: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), eos_token_id=None)


def test_batch_queue_keeps_one_disjoint_batch_per_stage_in_flight() -> None:
    sched, runner, queue = _scheduler(64), RecordingRunner(), BatchQueue(2)
    for rid in "abcd":
        sched.add_request(_request(rid, 5))
    so, out = queue.step(sched, runner)
    sched.update_from_output(so, out)
    # two batches of two requests each went out before the first came back
    assert runner.events == [("submit", ("a", "b")), ("submit", ("c", "d")), ("collect", ("a", "b"))]
    so, out = queue.step(sched, runner)
    sched.update_from_output(so, out)
    # a and b are free again: their next batch goes out while c and d's is collected
    assert runner.events[3:] == [("submit", ("a", "b")), ("collect", ("c", "d"))]
    assert queue.most_in_flight == 2 and all(r.num_output_tokens == 1 for r in sched.running)


def test_a_request_in_flight_is_never_preempted() -> None:
    sched, runner, queue = _scheduler(5), RecordingRunner(), BatchQueue(2)  # 4 usable blocks of 4 tokens
    first, second = _request("first", 8, max_tokens=8), _request("second", 8, max_tokens=8)
    sched.add_request(first)
    sched.add_request(second)
    so, out = queue.step(sched, runner)  # first's batch back; second's (the pool's last 2 blocks) in flight
    sched.update_from_output(so, out)
    assert runner.events == [("submit", ("first",)), ("submit", ("second",)), ("collect", ("first",))]
    # first needs a third block: the last admitted (second) is in flight, so first gives way, not second
    out_of_room = sched.schedule(in_flight=frozenset({"second"}))
    assert not out_of_room.chunks
    assert first.status is RequestStatus.PREEMPTED and second.status is RequestStatus.RUNNING
    assert sched.waiting[0] is first


def test_pp2_engine_pipelines_micro_batches_and_matches_pp1(tiny_pp2: LLM) -> None:
    prompts = [[1, 5, 9, 33, 7, 100], list(range(3, 40)), [8, 8, 8], list(range(50, 70))]
    base = token_ids(LLM("tiny", load_format="dummy", kv_cache_memory_bytes=KV), prompts, GREEDY)
    assert token_ids(tiny_pp2, prompts, GREEDY) == base
    assert tiny_pp2.llm_engine.batches is not None and tiny_pp2.llm_engine.batches.most_in_flight == 2


# ---- PP=2 against PP=1 -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pp2() -> Iterator[LLM]:
    """One PP=2 tiny-Llama engine for the module (its stage 0 is killed by the last test)."""
    yield from parallel.tiny_engine(pipeline_parallel_size=2)


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen2"])
def test_tiny_presets_pp2_match_pp1(model: str, tiny_pp2: LLM) -> None:
    parallel.assert_matches_one_rank(model, tiny_pp2, pipeline_parallel_size=2)


def test_chunked_prefill_and_seeded_sampling_match_pp1(tiny_pp2: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True, logprobs=2)
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}  # the 37-token prompt in 3 chunks
    base = LLM("tiny", load_format="dummy", kv_cache_memory_bytes=KV, **chunked)
    with LLM("tiny", load_format="dummy", kv_cache_memory_bytes=KV, pipeline_parallel_size=2, **chunked) as pp:
        assert token_ids(pp, PROMPTS, GREEDY) == token_ids(base, PROMPTS, GREEDY)
    assert token_ids(tiny_pp2, PROMPTS, seeded) == token_ids(base, PROMPTS, seeded)


def test_batches_of_aborted_requests_are_still_collected(tiny_pp2: LLM) -> None:
    """Aborting every request with batches in flight leaves the engine stepping until they are back (else stage 0
    would wait in its send until the gloo timeout and the worker would die idle)."""
    engine = tiny_pp2.llm_engine
    for rid, prompt in (("x", PROMPTS[0]), ("y", PROMPTS[1])):
        engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    assert engine.batches is not None and engine.batches.in_flight  # y's batch is still out
    engine.abort_request(["x", "y"])
    assert engine.has_unfinished_requests()
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.batches.in_flight
    assert token_ids(tiny_pp2, PROMPTS, GREEDY)  # and the pipeline still runs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_micro_batches_matches_pp1(mode: str) -> None:
    """A KV pool too small for all four requests: preempted requests (recomputed, or swapped out and back in on
    every stage) still give PP=1's ids."""
    prompts = [list(range(3, 40)), list(range(50, 80)), list(range(100, 125)), list(range(200, 230))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = {"load_format": "dummy", "num_gpu_blocks_override": 10, "max_model_len": 128, "preemption_mode": mode,
              "swap_space": 0.01}
    base = token_ids(LLM("tiny", **kwargs), prompts, params)
    with LLM("tiny", pipeline_parallel_size=2, **kwargs) as pp:
        assert token_ids(pp, prompts, params) == base
        assert pp.llm_engine.scheduler.num_preemptions > 0


def test_tp2_x_pp2_matches_one_rank() -> None:
    base = token_ids(LLM("tiny", load_format="dummy", kv_cache_memory_bytes=KV), PROMPTS, GREEDY)
    with LLM("tiny", load_format="dummy", kv_cache_memory_bytes=KV, tensor_parallel_size=2,
             pipeline_parallel_size=2) as both:
        assert token_ids(both, PROMPTS, GREEDY) == base


def test_tp2_x_pp2_runs_micro_batches_whose_steps_overflow_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hang of TP2 x PP2 on GPUs (Llama-70B offline throughput, 32 x 512-token prompts a micro-batch): rank 0
    submits the second micro-batch before it runs its part of the first, writing that step to every rank's stdin.
    The last stage's other TP rank does not read it: it is inside the first batch's all-reduce, waiting for rank 0.
    A step over the pipe's capacity (64 KiB) left rank 0 blocked in the write and that rank blocked in the
    collective, for good on NCCL (gloo times out). Ranks now read their pipe on a thread of their own."""
    import fcntl

    from engine.parallel import codec
    from engine.parallel.executor import TPDriverRunner

    monkeypatch.setenv("KVFLOW_TP_TIMEOUT_S", "30")  # without the fix: a gloo timeout, not a two-minute wait
    read_end, write_end = os.pipe()
    pipe_bytes = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
    os.close(read_end)
    os.close(write_end)
    prompts = [[100 + (7 * i + 13 * r) % 400 for i in range(1000)] for r in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    kwargs = {"load_format": "dummy", "kv_cache_memory_bytes": 1 << 25, "max_model_len": 1024,
              "max_num_batched_tokens": 16384}
    sizes: list[int] = []
    submit = TPDriverRunner.submit
    monkeypatch.setattr(TPDriverRunner, "submit",
                        lambda self, so: (sizes.append(len(codec.encode(so))), submit(self, so))[1])
    with LLM("tiny", tensor_parallel_size=2, pipeline_parallel_size=2, **kwargs) as both:
        ids = token_ids(both, prompts, params)
        assert both.llm_engine.batches is not None and both.llm_engine.batches.most_in_flight == 2
    assert sorted(sizes)[-2] > pipe_bytes  # the second batch in flight did not fit the pipe
    assert ids == token_ids(LLM("tiny", **kwargs), prompts, params)


def test_stages_of_unequal_kv_sizes_allocate_the_smallest_block_count(tmp_path: Path) -> None:
    """3 layers at PP2: stage 0 holds 2, stage 1 (rank 0, the scheduler's) 1, so the same KV budget holds twice as
    many blocks on rank 0 as on stage 0 (on GPUs the memory profiles differ per stage too). The engine's block
    count, whose ids the scheduler hands out to every stage, is the smallest over the whole world, not rank 0's."""
    import json

    from engine.models.presets import preset_hf_config

    (tmp_path / "config.json").write_text(json.dumps(preset_hf_config("tiny-llama").to_dict()
                                                     | {"num_hidden_layers": 3}))
    kwargs = {"load_format": "dummy", "kv_cache_memory_bytes": KV}
    with LLM(str(tmp_path), pipeline_parallel_size=2, **kwargs) as pp:
        layer_bytes = pp.llm_engine.runner.block_bytes  # rank 0's stage holds one layer
        assert pp.llm_engine.num_gpu_blocks == KV // (2 * layer_bytes) < KV // layer_bytes
        ids = token_ids(pp, PROMPTS, GREEDY)
    assert ids == token_ids(LLM(str(tmp_path), **kwargs), PROMPTS, GREEDY)


def test_smollm2_pp3_matches_pp1_greedy_and_logprobs() -> None:
    """Real weights, each stage reading only its tensors; 30 layers in stages of 10."""
    kwargs = {"kv_cache_memory_bytes": 1 << 26, "max_model_len": 512}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    theirs = LLM("smollm2", **kwargs).chat(messages, greedy)[0].outputs[0]
    with LLM("smollm2", pipeline_parallel_size=3, **kwargs) as pp:
        ours = pp.chat(messages, greedy)[0].outputs[0]
        constrained = pp.generate("My favourite number:", SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"\d{3}")))
    assert ours.text == "The capital of France is Paris."
    assert ours.token_ids == theirs.token_ids
    assert ours.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-3)
    assert re.fullmatch(r"\d{3}", constrained[0].outputs[0].text)  # the grammar masks the last stage's logits


def test_ranks_outlive_the_thread_that_built_the_engine() -> None:
    """A worker builds its engine on a passing thread (cluster/worker/threads.py); the ranks' death signal follows
    the thread that started them, so they must not be started on that one."""
    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(LLM("tiny", load_format="dummy", kv_cache_memory_bytes=KV,
                                                              pipeline_parallel_size=2)))
    thread.start()
    thread.join()
    time.sleep(0.5)
    with built[0] as llm:
        assert all(proc.poll() is None for proc in llm.llm_engine.runner._procs)  # type: ignore[attr-defined]
        assert token_ids(llm, PROMPTS[:1], GREEDY)


def test_worker_info_reports_the_pipeline(tiny_pp2: LLM) -> None:
    parallel.assert_worker_reports(tiny_pp2, tensor_parallel_size=1, pipeline_parallel_size=2)


def test_a_killed_stage_makes_the_engine_raise_not_hang(tiny_pp2: LLM) -> None:
    """Last user of `tiny_pp2`: kills stage 0 (world rank 1), which the engine's stage waits on."""
    started = parallel.kill_rank_1(tiny_pp2)
    assert time.monotonic() - started < 30


# ---- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size \(--pipeline-parallel-size\) must be >= 1, got 0"),
    ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 exceeds the model's 2 decoder layers"),
    ({"pipeline_parallel_size": 2, "kv_cache_dtype": "fp8"}, "--pipeline-parallel-size 2 with kv_cache_dtype"),
    ({"pipeline_parallel_size": 2, "quantization": "fp8"}, "--pipeline-parallel-size 2 with quantization"),
    ({"pipeline_parallel_size": 2, "kv_offloading_size": 1.0}, "--kv-offloading-size with --pipeline-parallel-size 2"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative decoding with pipeline_parallel_size > 1"),
])
def test_bad_pipeline_layouts_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="tiny", load_format="dummy", **kwargs).create_engine_config()


def test_a_model_class_without_stages_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models import registry

    class Unsplittable:
        def __init__(self, arch: object, hf_config: object, backend: object, max_positions: int) -> None: ...

    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 is not supported for Qwen3MoeForCausalLM"):
        EngineArgs(model="tiny-qwen3-moe", load_format="dummy", pipeline_parallel_size=2).create_engine_config()
    monkeypatch.setattr(registry, "model_class", lambda architecture: Unsplittable)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 is not supported for LlamaForCausalLM"):
        EngineArgs(model="tiny", load_format="dummy", pipeline_parallel_size=2).create_engine_config()


def test_pp_flag_and_short_form_parse() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for argv in (["--pipeline-parallel-size", "2"], ["-pp", "2"]):
        assert EngineArgs.from_cli_args(parser.parse_args(["--model", "tiny", *argv])).pipeline_parallel_size == 2


def test_serve_runs_pipeline_workers_without_prefill_workers() -> None:
    assert pipeline_prefill_workers(2, None) == pipeline_prefill_workers(2, 0) == 0
    assert pipeline_prefill_workers(1, None) is None and pipeline_prefill_workers(1, 2) == 2
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2 with --prefill-workers 1"):
        pipeline_prefill_workers(2, 1)
    assert worker_counts(pipeline_prefill_workers(2, None), None, None) == (0, 1)  # one decode worker


def test_launcher_places_a_workers_stages_on_consecutive_gpus() -> None:
    args = EngineArgs(model="tiny", load_format="dummy", pipeline_parallel_size=2)
    placed = place_workers(ClusterSpec(args, 0, 2), 4)
    assert [(p.gpu, sorted(p.gpus)) for p in placed] == [(0, [0, 1]), (2, [2, 3])]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2 needs 4 GPUs per worker"):
        place_workers(ClusterSpec(EngineArgs(model="tiny", tensor_parallel_size=2, pipeline_parallel_size=2), 0, 1),
                      2)


def test_stage_dummy_weights_equal_the_full_models_slice() -> None:
    resolved = resolve_model("tiny", "dummy")
    arch, cls = resolved.arch, model_class(resolved.arch.architecture)
    full = cls(arch, resolved.hf_config, TorchPagedAttention(16), 64)
    full.init_dummy_weights(0)
    stage = cls(arch, resolved.hf_config, TorchPagedAttention(16), 64, stage=PipelineStage.of(2, 1, 2))
    stage.init_dummy_weights(0)
    for (name, ours), theirs in zip(stage.named_parameters(), full.parameters(), strict=True):
        if not ours.is_meta:
            assert torch.equal(ours, theirs), name
