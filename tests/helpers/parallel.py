"""What the tensor- and pipeline-parallel engine tests share (CPU, gloo): the tiny prompts and greedy parameters,
the ids an engine generates for them, and the checks run against a built parallel engine (the layout its worker
reports, and a killed rank)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from engine.parallel.executor import TensorParallelError
from engine.sampling_params import SamplingParams
from kvflow import LLM

KV = 1 << 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7, 100], list(range(3, 40))]


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def tiny_engine(**parallel: int) -> Iterator[LLM]:
    """A module fixture's body: the tiny Llama (dummy weights) with `parallel` sizes, closed after the module."""
    llm = LLM("tiny", load_format="dummy", kv_cache_memory_bytes=KV, **parallel)
    yield llm
    llm.close()


def assert_matches_one_rank(model: str, tiny_parallel: LLM, **parallel: int) -> None:
    """`model`'s greedy ids with `parallel` sizes equal one rank's (the tiny preset reuses `tiny_parallel`, the
    module's engine of those sizes)."""
    base = token_ids(LLM(model, load_format="dummy", kv_cache_memory_bytes=KV), PROMPTS, GREEDY)
    if model == "tiny":
        assert token_ids(tiny_parallel, PROMPTS, GREEDY) == base
        return
    with LLM(model, load_format="dummy", kv_cache_memory_bytes=KV, **parallel) as llm:
        assert token_ids(llm, PROMPTS, GREEDY) == base


def assert_worker_reports(llm: LLM, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """The worker's info answer carries the engine's parallel layout, one CPU device per rank."""
    from cluster.worker.runtime import info_response
    from protos.kvflow.v1 import kvflow_pb2 as pb

    info = info_response(llm.llm_engine, pb.WORKER_ROLE_DECODE, "decode-0")
    ranks = tensor_parallel_size * pipeline_parallel_size
    assert (info.tensor_parallel_size, info.pipeline_parallel_size, list(info.rank_devices)) == (
        tensor_parallel_size, pipeline_parallel_size, ["cpu"] * ranks)
    # CPU ranks sum over gloo; a single rank per stage has no all-reduce to run
    assert info.all_reduce == ("gloo" if tensor_parallel_size > 1 else "none")


def kill_rank_1(llm: LLM) -> float:
    """Kill the engine's first child process (world rank 1) and check that the next generate raises naming it;
    returns the time.monotonic() at which the rank was dead."""
    child = llm.llm_engine.runner._procs[0]  # type: ignore[attr-defined]
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        token_ids(llm, PROMPTS, GREEDY)
    return started
