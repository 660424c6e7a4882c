"""The peer-memory all-reduce's CPU-checkable parts: the collective set-up is all-or-nothing and never hangs, the
size rule that picks it over NCCL, and the flags that turn it on (opt-in) and off. The kernel itself needs GPUs that map each
other's memory: bench/tp_gpu.py --parts allreduce check checks it bit-exact, eager and in graphs."""

from __future__ import annotations

import argparse
import datetime
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine.arg_utils import EngineArgs
from engine.parallel.peer_all_reduce import PeerAllReduce, default_max_bytes


def _setup_all(size: int, timeout_s: float = 20.0) -> list[tuple[Any, str]]:
    """PeerAllReduce.setup on `size` threads sharing one store, as `size` ranks would."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    results: list[Any] = [None] * size

    def rank(r: int) -> None:
        results[r] = PeerAllReduce.setup(store, r, size, torch.device("cpu"), 1.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5)
    assert not any(thread.is_alive() for thread in threads), "set-up hung"
    return results


def test_setup_without_peer_memory_leaves_every_rank_on_nccl_with_the_same_reason() -> None:
    results = _setup_all(2)
    assert [peer for peer, _ in results] == [None, None]
    reasons = {why for _, why in results}
    assert len(reasons) == 1 and next(iter(reasons)).startswith("rank 0:")


class _NoDriver:
    """Stands in for libcuda where nothing is allocated (the rule tests only)."""


def test_fits_takes_small_contiguous_float_tensors_only() -> None:
    driver: Any = _NoDriver()
    peer = PeerAllReduce(driver, 0, [0, 0], 0, torch.device("cpu"), max_bytes=1024, programs=4, timeout_s=1.0)
    assert peer.fits(torch.zeros(512, dtype=torch.bfloat16))  # exactly 1 KiB
    assert peer.fits(torch.zeros(256, dtype=torch.float32))
    assert not peer.fits(torch.zeros(513, dtype=torch.bfloat16))  # over the threshold: NCCL
    assert not peer.fits(torch.zeros(0, dtype=torch.bfloat16))
    assert not peer.fits(torch.zeros(64, dtype=torch.int32))
    assert not peer.fits(torch.zeros(8, 8, dtype=torch.float16).t())  # not contiguous
    assert peer.describe() == "peer one-shot up to 1 KiB (2 ranks), nccl above"


def test_setup_refuses_a_signal_area_too_small_for_the_grid() -> None:
    with pytest.raises(ValueError, match="signal area"):
        PeerAllReduce.setup(dist.HashStore(), 0, 8, torch.device("cpu"), 1.0, programs=4096)


def test_the_one_shot_threshold_falls_with_the_rank_count_as_measured() -> None:
    """Each call reads (ranks - 1) x the message from peers: NCCL catches up at 4 MB on 4 H200s, not on 2."""
    assert default_max_bytes(2) == 4 << 20
    assert default_max_bytes(4) == 2 << 20
    assert default_max_bytes(8) == 1 << 20  # unmeasured: the one-shot is opt-in there


def test_custom_all_reduce_is_tp2_tp4_on_cuda_by_default_and_vllms_disable_flag_keeps_nccl() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def args(*flags: str) -> EngineArgs:
        return EngineArgs.from_cli_args(parser.parse_args(["--model", "tiny", *flags]))

    assert args().create_engine_config().device.custom_all_reduce is False
    assert args("-tp", "2").create_engine_config().device.custom_all_reduce is False  # CPU ranks sum over gloo
    assert args("-tp", "2")._device_config("cuda").custom_all_reduce is True  # measured faster end to end
    assert args("-tp", "4")._device_config("cuda").custom_all_reduce is True  # 2.4x NCCL at decode sizes, exact
    assert args("-tp", "8")._device_config("cuda").custom_all_reduce is False  # not measured at 8: NCCL
    assert args("-tp", "4", "--enable-custom-all-reduce")._device_config("cuda").custom_all_reduce is True
    assert args("-tp", "2", "--disable-custom-all-reduce")._device_config("cuda").custom_all_reduce is False
    assert args("--disable-custom-all-reduce").create_engine_config().device.custom_all_reduce is False
    assert args("--enable-custom-all-reduce")._device_config("cuda").custom_all_reduce is True
    with pytest.raises(ValueError, match="contradict"):
        args("--enable-custom-all-reduce", "--disable-custom-all-reduce").create_engine_config()
    with pytest.raises(ValueError, match="needs CUDA GPUs"):  # this machine's device: CPU ranks sum over gloo
        args("--enable-custom-all-reduce", "--device", "cpu").create_engine_config()


def test_a_call_fails_when_the_watchdog_flags_a_failure_while_it_runs() -> None:
    """A one-shot all-reduce whose peer died returns (wrong sums) after its wait; the watchdog has flagged the dead
    rank by then, and the step must fail rather than hand those sums on."""
    from engine.parallel.executor import TensorParallelError, TPDriverRunner

    runner = object.__new__(TPDriverRunner)  # only the failure bookkeeping: no ranks are started
    runner._failure = None

    def step_while_a_rank_dies() -> str:
        runner._fail("tensor-parallel rank 1 exited with code -9")
        return "sums computed without rank 1"

    with pytest.raises(TensorParallelError, match="rank 1 exited"):
        runner._guard(step_while_a_rank_dies)
    runner._failure = None
    assert runner._guard(lambda: "ok") == "ok"
