"""Default max_num_seqs / max_num_batched_tokens by device and usage context, as vLLM's get_batch_defaults."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from engine.arg_utils import EngineArgs, default_batch_limits, device_batch_limits
from engine.config import GiB
from kvflow.cli import build_parser
from kvflow.launcher import engine_argv

# (total_memory, name) as torch.cuda.get_device_properties reports them (about 79 / 140 / 79 / 22 GiB)
H100 = (85_045_233_664, "NVIDIA H100 80GB HBM3")
H200 = (150_754_820_096, "NVIDIA H200")
A100 = (85_089_304_576, "NVIDIA A100-SXM4-80GB")
L4_24GB = (23_580_639_232, "NVIDIA L4")


@pytest.mark.parametrize(("gpu", "llm", "server"), [
    (H100, (1024, 16384), (1024, 8192)),
    (H200, (1024, 16384), (1024, 8192)),
    (A100, (256, 8192), (256, 2048)),
    (L4_24GB, (256, 8192), (256, 2048)),
])
def test_cuda_defaults_follow_vllm(gpu: tuple[int, str], llm: tuple[int, int], server: tuple[int, int]) -> None:
    memory, name = gpu
    assert default_batch_limits("cuda", "llm", memory, name) == llm
    assert default_batch_limits("cuda:0", "server", memory, name) == server


def test_large_gpu_threshold_and_a100_name_match() -> None:
    assert default_batch_limits("cuda", "llm", 70 * GiB, "GPU") == (1024, 16384)
    assert default_batch_limits("cuda", "llm", 70 * GiB - 1, "GPU") == (256, 8192)
    assert default_batch_limits("cuda", "llm", 80 * GiB, "nvidia a100 80gb pcie") == (256, 8192)
    assert default_batch_limits("cuda", "server", None, None) == (256, 2048)  # unknown memory: the small defaults


@pytest.mark.parametrize("context", ["llm", "server"])
def test_cpu_keeps_kvflow_defaults(context: str) -> None:
    assert default_batch_limits("cpu", context, None, None) == (256, 8192)
    assert default_batch_limits("cpu", context, 512 * GiB, "NVIDIA H100") == (256, 8192)  # memory ignored off CUDA
    assert device_batch_limits("cpu", context) == (256, 8192)


def test_bad_usage_context_raises() -> None:
    with pytest.raises(ValueError, match="usage_context"):
        default_batch_limits("cpu", "api", None, None)
    with pytest.raises(ValueError, match="usage_context"):
        EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                   usage_context="api").create_engine_config()  # type: ignore[arg-type]


@pytest.mark.parametrize("context", ["llm", "server"])
def test_cpu_engine_config_resolves_to_256_8192(context: str) -> None:
    config = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                        usage_context=context).create_engine_config()  # type: ignore[arg-type]
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, 8192)


def test_explicit_values_win() -> None:
    config = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu", max_num_seqs=7,
                        max_num_batched_tokens=300).create_engine_config()
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (7, 300)
    assert default_batch_limits("cuda", "llm", *H100) == (1024, 16384)  # what the explicit values overrode


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, memory: int, name: str) -> list[object]:
    asked: list[object] = []

    def props(device: object) -> SimpleNamespace:
        asked.append(device)
        return SimpleNamespace(total_memory=memory, name=name)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return asked


@pytest.mark.parametrize(("context", "expected"), [("llm", (1024, 16384)), ("server", (1024, 8192))])
def test_engine_config_reads_the_cuda_device(monkeypatch: pytest.MonkeyPatch, context: str,
                                             expected: tuple[int, int]) -> None:
    asked = _fake_gpu(monkeypatch, *H100)
    config = EngineArgs(model="tiny-llama", load_format="dummy", device="cuda:0",
                        usage_context=context).create_engine_config()  # type: ignore[arg-type]
    assert asked == ["cuda:0"]
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == expected
    explicit = EngineArgs(model="tiny-llama", load_format="dummy", device="cuda:0", max_num_seqs=64,
                          usage_context=context).create_engine_config()  # type: ignore[arg-type]
    assert (explicit.scheduler.max_num_seqs, explicit.scheduler.max_num_batched_tokens) == (64, expected[1])


def test_no_chunked_prefill_budget_covers_max_model_len(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, *L4_24GB)
    config = EngineArgs(model="tiny-llama", load_format="dummy", device="cuda", usage_context="server",
                        enable_chunked_prefill=False).create_engine_config()
    assert config.scheduler.max_num_batched_tokens == max(config.model.max_model_len, 2048)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        EngineArgs(model="tiny-llama", load_format="dummy", device="cpu", enable_chunked_prefill=False,
                   max_model_len=1024, max_num_batched_tokens=512).create_engine_config()


def test_cli_defaults_are_none_and_offline_commands_stay_llm() -> None:
    parser = build_parser()
    ns = parser.parse_args(["generate", "--model", "tiny", "hi"])
    assert ns.max_num_seqs is None and ns.max_num_batched_tokens is None
    assert EngineArgs.from_cli_args(ns).usage_context == "llm"
    ns = parser.parse_args(["bench", "throughput", "--model", "tiny"])
    assert EngineArgs.from_cli_args(ns).usage_context == "llm"
    ns = parser.parse_args(["generate", "--model", "tiny", "--max-num-seqs", "3", "hi"])
    assert EngineArgs.from_cli_args(ns).max_num_seqs == 3


def test_serve_and_workers_use_the_server_context() -> None:
    from cluster.worker.args import server_engine_args

    parser = build_parser()
    ns = parser.parse_args(["serve", "--model", "tiny", "--max-num-seqs", "12"])
    args = server_engine_args(ns)
    assert args.usage_context == "server" and args.model == "tiny" and args.max_num_seqs == 12
    for role in ("prefill", "decode"):
        ns = parser.parse_args([role, "--port", "1", "--model", "tiny"])
        args = server_engine_args(ns)
        assert args.usage_context == "server" and args.max_num_seqs is None


def test_launcher_forwards_explicit_limits_but_not_the_usage_context() -> None:
    args = dataclasses.replace(EngineArgs(model="tiny"), usage_context="server")
    assert engine_argv(args) == ["--model", "tiny"]
    argv = engine_argv(dataclasses.replace(args, max_num_seqs=256, max_num_batched_tokens=8192))
    assert argv == ["--model", "tiny", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]
    ns = build_parser().parse_args(["decode", "--port", "1", *argv])  # the worker accepts what it is given
    assert (ns.max_num_seqs, ns.max_num_batched_tokens) == (256, 8192)
