"""Offline throughput: random-token prompts through `LLM.generate`, like `vllm bench throughput`."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ThroughputResult:
    num_prompts: int
    input_len: int
    output_len: int
    elapsed_s: float
    requests_per_s: float
    output_tok_s: float
    total_tok_s: float
    num_output_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    # Skip the first ids: they are special/control tokens in most vocabularies.
    low = min(1000, vocab_size // 4)
    ids = rng.integers(low, vocab_size, size=(num_prompts, input_len))
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def cpu_model() -> str:
    """e.g. 'AMD EPYC (family 26, model 2)': the dev VM's host CPU changes between sessions, and with it the speed."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        return platform.processor() or "unknown"
    return f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def host_context() -> dict[str, Any]:
    return {"host": platform.machine(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__}


def run_throughput(engine_args: EngineArgs, num_prompts: int, input_len: int, output_len: int,
                   ignore_eos: bool, seed: int = 0) -> tuple[ThroughputResult, dict[str, Any]]:
    from kvflow.llm import LLM

    llm = LLM(**vars(engine_args))
    vocab = llm.llm_engine.config.model.arch.vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=ignore_eos)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = ThroughputResult(
        num_prompts=num_prompts, input_len=input_len, output_len=output_len, elapsed_s=round(elapsed, 3),
        requests_per_s=round(num_prompts / elapsed, 3), output_tok_s=round(num_out / elapsed, 2),
        total_tok_s=round((num_out + num_prompts * input_len) / elapsed, 2), num_output_tokens=num_out,
    )
    config = llm.llm_engine.config
    context = {
        "model": config.model.model, "dtype": config.model.dtype, "device": config.device.device,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "num_kv_blocks": llm.llm_engine.num_gpu_blocks, "num_preemptions": llm.stats.num_preemptions,
        "tensor_parallel_size": config.device.tensor_parallel_size,
        "pipeline_parallel_size": config.device.pipeline_parallel_size, **host_context(), "ignore_eos": ignore_eos,
    }
    llm.close()  # the other tensor-parallel ranks, if any
    return result, context


def format_line(result: ThroughputResult) -> str:
    return (f"Throughput: {result.requests_per_s:.2f} requests/s, {result.total_tok_s:.2f} total tokens/s, "
            f"{result.output_tok_s:.2f} output tokens/s ({result.num_prompts} prompts x {result.input_len} in / "
            f"{result.output_len} out in {result.elapsed_s:.2f}s)")


def to_json(result: ThroughputResult, context: dict[str, Any]) -> str:
    return json.dumps({**result.as_dict(), **context})
