"""CPU workers' memory (engine/process/memory_budget.py): KV bytes per token from the model, the default KV size from the
host's available memory shared among the workers, the explicit override, and the one-line refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.config import CacheConfig, DeviceConfig, EngineConfig, GiB, ModelConfig, SchedulerConfig
from engine.models.arch import ModelArch
from engine.process.memory_budget import (
    KV_SHARE_OF_AVAILABLE,
    cpu_worker_memory,
    default_kv_bytes,
    kv_bytes_for_tokens,
    kv_bytes_per_token,
    kv_tokens_in,
    mem_available_bytes,
    weight_bytes,
)

SMOLLM2 = ModelArch("LlamaForCausalLM", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
                    max_position_embeddings=8192, tie_word_embeddings=True, qkv_bias=False, qk_norm=False)


def config(max_model_len: int = 8192, max_num_seqs: int = 256, kv_dtype: str = "auto", tp: int = 1,
           kv_bytes: int | None = None, blocks: int | None = None, host_tier: int = 0) -> EngineConfig:
    model = ModelConfig("smollm2", "smollm2", None, None, SMOLLM2, None, dtype="float32", max_model_len=max_model_len)
    return EngineConfig(model, CacheConfig(kv_cache_memory_bytes=kv_bytes, num_gpu_blocks_override=blocks,
                                           kv_cache_dtype=kv_dtype, kv_offloading_bytes=host_tier),
                        SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
                        DeviceConfig(device="cpu", tensor_parallel_size=tp))


def test_kv_bytes_per_token_come_from_layers_kv_heads_head_dim_and_dtype() -> None:
    assert kv_bytes_per_token(config()) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(config(kv_dtype="fp8_e4m3")) == 46080 // 4
    assert kv_bytes_per_token(config(tp=3)) == 46080 // 3
    # whole blocks, plus the padding block 0
    assert kv_bytes_for_tokens(config(), 8192) == (512 + 1) * 16 * 46080
    assert kv_tokens_in(config(), kv_bytes_for_tokens(config(), 8192)) == 8192


def test_weights_count_the_packed_copy_of_a_tied_fp32_head() -> None:
    embedding = 49152 * 576 * 4
    assert weight_bytes(config()) == SMOLLM2.num_params * 4 + embedding


def test_default_kv_is_a_share_of_available_memory_split_among_the_workers() -> None:
    available = 22 * GiB
    one, two = default_kv_bytes(config(), 1, available), default_kv_bytes(config(), 2, available)
    block = 16 * 46080
    assert one % block == 0 and two % block == 0
    assert abs(two - available * KV_SHARE_OF_AVAILABLE / 2) < block
    assert abs(one - 2 * two) <= 2 * block


def test_default_kv_holds_one_sequence_at_least_and_max_num_seqs_at_most() -> None:
    least = kv_bytes_for_tokens(config(), 8192)
    assert default_kv_bytes(config(), 2, 1 * GiB) == least
    small = config(max_model_len=512, max_num_seqs=4)
    assert default_kv_bytes(small, 1, 512 * GiB) == kv_bytes_for_tokens(small, 4 * 512)


def test_default_serve_of_smollm2_stays_small() -> None:
    """`make serve` (1 prefill + 1 decode worker) on a 23 GB host: ~4 GB estimated, not 2 x 5.6 GB."""
    worker = cpu_worker_memory(config(), 2, 22 * GiB)
    assert kv_tokens_in(config(), worker.kv_cache) >= 8192
    assert 2 * worker.total < 4.2 * GiB
    assert worker.total == worker.weights + worker.kv_cache + worker.runtime
    assert "KV cache" in worker.describe() and "tokens" in worker.describe()


def test_explicit_kv_is_kept_and_checked_against_max_model_len() -> None:
    assert cpu_worker_memory(config(kv_bytes=1 * GiB), 2, 22 * GiB).kv_cache == GiB
    assert cpu_worker_memory(config(blocks=600), 2, 22 * GiB).kv_cache == 600 * 16 * 46080
    with pytest.raises(ValueError, match="fewer than max_model_len") as caught:
        cpu_worker_memory(config(kv_bytes=64 << 20), 1, 22 * GiB)
    assert "\n" not in str(caught.value)
    assert cpu_worker_memory(config(max_model_len=1024, kv_bytes=64 << 20), 1, None).kv_cache == 64 << 20


def test_workers_the_host_cannot_hold_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="available memory") as caught:
        cpu_worker_memory(config(), 8, 4 * GiB)
    assert "\n" not in str(caught.value) and "8 CPU worker" in str(caught.value)
    with pytest.raises(ValueError, match="available memory"):
        cpu_worker_memory(config(kv_bytes=4 * GiB), 2, 8 * GiB)
    with pytest.raises(ValueError, match="at least one"):
        cpu_worker_memory(config(), 0, 8 * GiB)


def test_a_host_kv_tier_counts_in_full() -> None:
    plain = cpu_worker_memory(config(kv_bytes=GiB), 2, 22 * GiB)
    tiered = cpu_worker_memory(config(kv_bytes=GiB, host_tier=2 * GiB), 2, 22 * GiB)
    assert tiered.total == plain.total + 2 * GiB and "host KV tier 2.00 GiB" in tiered.describe()
    with pytest.raises(ValueError, match="host KV tier 8.00 GiB"):
        cpu_worker_memory(config(kv_bytes=GiB, host_tier=8 * GiB), 2, 16 * GiB)


def test_unknown_available_memory_refuses_nothing_and_takes_one_sequence() -> None:
    worker = cpu_worker_memory(config(), 64, None)
    assert worker.kv_cache == kv_bytes_for_tokens(config(), 8192)


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nMemFree:  19540936 kB\nMemAvailable:   23313396 kB\n")
    assert mem_available_bytes(meminfo) == 23313396 * 1024
    assert mem_available_bytes(tmp_path / "absent") is None
    meminfo.write_text("MemTotal: 1 kB\n")
    assert mem_available_bytes(meminfo) is None


def test_configs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu_worker_memory(config(), 1, 22 * GiB).kv_cache = 0  # type: ignore[misc]
