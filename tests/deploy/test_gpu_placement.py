"""Where `kvflow serve` puts its workers and how much GPU memory each may take (no GPU needed: pure rules), and
vLLM's start-up check of a worker's memory share."""

from __future__ import annotations

import pytest

from engine.arg_utils import EngineArgs
from engine.runner.memory import GpuMemory
from kvflow.launcher import ClusterSpec, Placement, engine_argv, place_workers

GiB = 1 << 30


def spec(prefill: int, decode: int, **kwargs: object) -> ClusterSpec:
    return ClusterSpec(EngineArgs(model="tiny", load_format="dummy"), prefill, decode, **kwargs)  # type: ignore[arg-type]


def test_default_spreads_workers_over_gpus_prefill_first() -> None:
    assert place_workers(spec(1, 1), 2) == [Placement("prefill", 0, 0.9), Placement("decode", 1, 0.9)]
    assert [p.gpu for p in place_workers(spec(2, 2), 4)] == [0, 1, 2, 3]
    assert [p.gpu for p in place_workers(spec(0, 2), 2)] == [0, 1]


def test_workers_share_a_gpu_when_there_are_fewer_gpus_and_split_the_default_share() -> None:
    one_gpu = place_workers(spec(1, 1), 1)
    assert one_gpu == [Placement("prefill", 0, 0.45), Placement("decode", 0, 0.45)]
    three_on_two = place_workers(spec(1, 2), 2)
    assert [p.gpu for p in three_on_two] == [0, 1, 0]
    assert [p.gpu_memory_utilization for p in three_on_two] == [0.45, 0.9, 0.45]
    assert sum(p.gpu_memory_utilization for p in place_workers(spec(2, 1), 1)) <= 0.9  # type: ignore[misc]


def test_explicit_lists_and_shares_are_each_workers_own() -> None:
    placed = place_workers(spec(1, 1, prefill_gpus=(1,), decode_gpus=(0,), gpu_memory_utilization=0.4), 2)
    assert placed == [Placement("prefill", 1, 0.4), Placement("decode", 0, 0.4)]
    placed = place_workers(spec(1, 2, decode_gpus=(1, 1)), 2)  # the prefill worker takes the default spread
    assert [(p.role, p.gpu, p.gpu_memory_utilization) for p in placed] == \
        [("prefill", 0, 0.9), ("decode", 1, 0.45), ("decode", 1, 0.45)]


@pytest.mark.parametrize("kwargs,num_gpus,message", [
    (dict(prefill_gpus=(0, 1)), 2, "lists 2 GPUs for 1 prefill"),
    (dict(decode_gpus=(3,)), 2, r"only GPUs 0..1"),
    (dict(decode_gpus=(0,)), 0, "need visible GPUs"),
])
def test_bad_placements_are_refused_before_any_worker_starts(kwargs: dict, num_gpus: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        place_workers(spec(1, 1, **kwargs), num_gpus)


def test_cpu_clusters_place_nothing_and_a_fixed_cuda_index_is_refused() -> None:
    assert place_workers(spec(1, 1), 0) == [Placement("prefill", None, None), Placement("decode", None, None)]
    cpu = ClusterSpec(EngineArgs(model="tiny", device="cpu"), 1, 1)
    assert place_workers(cpu, 2) == [Placement("prefill", None, None), Placement("decode", None, None)]
    with pytest.raises(ValueError, match="--prefill-gpus"):
        place_workers(ClusterSpec(EngineArgs(model="tiny", device="cuda:1"), 1, 1), 2)


def test_device_and_share_are_not_forwarded_as_engine_flags() -> None:
    argv = engine_argv(EngineArgs(model="tiny", device="cuda", gpu_memory_utilization=0.5, max_num_seqs=8))
    assert "--device" not in argv and "--gpu-memory-utilization" not in argv
    assert argv == ["--model", "tiny", "--max-num-seqs", "8"]


def test_memory_share_check_names_what_is_in_use() -> None:
    total = 80 * GiB
    GpuMemory(free=50 * GiB, total=total, reserved=0).check_share(0.45, "cuda:0")  # type: ignore[arg-type]
    with pytest.raises(ValueError) as caught:  # another worker holds 40 GiB: 0.9 cannot fit
        GpuMemory(free=40 * GiB, total=total, reserved=0).check_share(0.9, "cuda:0")  # type: ignore[arg-type]
    text = str(caught.value)
    assert "40.00 of 80.00 GiB" in text and "gpu_memory_utilization=0.9 (72.00 GiB)" in text
    assert "40.00 GiB are in use by other processes" in text and "each worker's share" in text
