"""The host memory a CPU worker takes (weights + KV cache + runtime), and its default KV cache size.

A GPU worker sizes its KV cache from its share of the GPU after profiling (engine/runner/memory.py). A CPU worker
has no such share: the host's memory is the OS's and every other process's too, so `kvflow serve` sizes each CPU
worker's KV cache before starting it, from the model (bytes per token: layers x KV heads x head dim x 2 x the KV
dtype), `max_model_len`, `max_num_seqs` and the host's available memory (MemAvailable), shared among the worker
processes it starts:

- at least one `max_model_len` sequence (the engine refuses less), at most `max_num_seqs` of them (more is never
  used at once);
- in between, `KV_SHARE_OF_AVAILABLE` of MemAvailable, split among the processes. A CPU worker computes a few
  sequences at a time, so gigabytes of KV buy it little; the rest of the host stays free. SmolLM2 on a 23 GB host,
  two workers: ~0.45 GB of KV each (~9.8k tokens) instead of vLLM's fixed 4 GiB.

`--kv-cache-memory-bytes` (or `--num-gpu-blocks-override`) overrides the size. A host KV tier
(`--kv-offloading-size`) is host memory too and counts in full. Either way the workers' estimated total must fit `USABLE_SHARE_OF_AVAILABLE` of MemAvailable, or the launch is refused before any worker starts.
Estimates, not measurements: weights from the architecture's parameter count, the runtime from a measured base
plus the activations of the largest step. Pure functions of an `EngineConfig` (no torch), so they are cheap to test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig, GiB

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_SHARE_OF_AVAILABLE = 0.04
USABLE_SHARE_OF_AVAILABLE = 0.9  # the rest stays for the OS, the router and page cache
# Python, torch, transformers, gRPC, the tokenizer and the compiled kernels of one CPU worker, before weights and KV
# (measured ~470 MB on SmolLM2, 2 cores).
RUNTIME_BASE_BYTES = 512 << 20
QUANTIZED_BYTES_PER_PARAM = 1.0625  # a quantized linear's packed weight, at most Q8_0 (34 bytes per 32 weights)


@dataclass(frozen=True)
class WorkerMemory:
    """One worker process's estimated peak RSS, in bytes."""

    weights: int
    kv_cache: int
    runtime: int
    kv_tokens: int  # what `kv_cache` holds
    host_kv_tier: int = 0  # --kv-offloading-size (engine/core/host_tier.py)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.runtime + self.host_kv_tier

    def describe(self) -> str:
        tier = f" + host KV tier {_gib(self.host_kv_tier)}" if self.host_kv_tier else ""
        return (f"{_gib(self.total)} (weights {_gib(self.weights)} + KV cache {_gib(self.kv_cache)}, "
                f"{self.kv_tokens} tokens{tier} + runtime {_gib(self.runtime)})")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def kv_bytes_per_token(config: EngineConfig) -> int:
    """K and V of one token over this rank's layers (the largest pipeline stage's), its KV heads only."""
    arch, tp = config.model.arch, config.device.tensor_parallel_size
    dtype_bytes = 1 if config.cache.kv_cache_dtype == "fp8_e4m3" else DTYPE_BYTES[config.model.dtype]
    layers = -(-arch.num_layers // config.device.pipeline_parallel_size)
    return 2 * layers * max(arch.num_kv_heads // tp, 1) * arch.head_dim * dtype_bytes


def kv_bytes_for_tokens(config: EngineConfig, tokens: int) -> int:
    """Bytes of the blocks that hold `tokens`, plus block 0 (padding, never handed out)."""
    block_size = config.cache.block_size
    return (math.ceil(tokens / block_size) + 1) * block_size * kv_bytes_per_token(config)


def kv_tokens_in(config: EngineConfig, kv_bytes: int) -> int:
    """Tokens a KV budget holds, block 0 aside."""
    block_size = config.cache.block_size
    return max(kv_bytes // (block_size * kv_bytes_per_token(config)) - 1, 0) * block_size


def weight_bytes(config: EngineConfig) -> int:
    """This rank's weights: the parameters in the model dtype (quantized linears packed), plus oneDNN's packed
    copy of a tied fp32 logits head (engine/runner/cpu_linear.py: the embedding lookup keeps the plain one)."""
    arch, model = config.model.arch, config.model
    dtype_bytes = DTYPE_BYTES[model.dtype]
    embedding = arch.vocab_size * arch.hidden_size
    if model.quantization is None:
        total = arch.num_params * dtype_bytes
        if arch.tie_word_embeddings and model.dtype == "float32":
            total += embedding * dtype_bytes
    else:
        linear = arch.num_params - embedding * (1 if arch.tie_word_embeddings else 2)
        total = int(linear * QUANTIZED_BYTES_PER_PARAM) + 2 * embedding * dtype_bytes
    return total // (config.device.tensor_parallel_size * config.device.pipeline_parallel_size)


def runtime_bytes(config: EngineConfig) -> int:
    """The measured base plus the live activations of the largest step (`max_num_batched_tokens` rows through a
    layer: residual, qkv, attention out, gate|up and the MLP's activation) and fp32 logits of `max_num_seqs`
    sampled rows."""
    arch, sched, tp = config.model.arch, config.scheduler, config.device.tensor_parallel_size
    dtype_bytes = DTYPE_BYTES[config.model.dtype]
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim // tp
    per_token = dtype_bytes * (4 * arch.hidden_size + qkv + 4 * arch.intermediate_size // tp)
    logits = sched.max_num_seqs * arch.vocab_size * 4
    return RUNTIME_BASE_BYTES + sched.max_num_batched_tokens * per_token + logits


def explicit_kv_bytes(config: EngineConfig) -> int | None:
    """The KV size the user set (`--kv-cache-memory-bytes`, or `--num-gpu-blocks-override` blocks), else None."""
    cache = config.cache
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override * cache.block_size * kv_bytes_per_token(config)
    return cache.kv_cache_memory_bytes


def default_kv_bytes(config: EngineConfig, processes: int, available: int) -> int:
    """The module docstring's rule: `KV_SHARE_OF_AVAILABLE` of `available` split among `processes`, within
    [one max_model_len sequence, max_num_seqs of them], whole blocks."""
    sched = config.scheduler
    least = kv_bytes_for_tokens(config, sched.max_model_len)
    most = kv_bytes_for_tokens(config, sched.max_num_seqs * sched.max_model_len)
    block = config.cache.block_size * kv_bytes_per_token(config)
    share = int(available * KV_SHARE_OF_AVAILABLE / processes) // block * block
    return min(max(share, least), most)


def cpu_worker_memory(config: EngineConfig, processes: int, available: int | None) -> WorkerMemory:
    """Each of `processes` CPU worker processes' memory, its KV cache sized by `default_kv_bytes` unless set.
    Raises ValueError (one line) when the KV cache cannot hold one max_model_len sequence, or when the processes
    do not fit `available` (None: unknown, nothing refused; the default KV is then one sequence)."""
    if processes < 1:
        raise ValueError(f"need at least one worker process, got {processes}")
    sched = config.scheduler
    kv = explicit_kv_bytes(config)
    if kv is None:
        kv = default_kv_bytes(config, processes, available) if available is not None else \
            kv_bytes_for_tokens(config, sched.max_model_len)
    tokens = kv_tokens_in(config, kv)
    if tokens < sched.max_model_len:
        raise ValueError(f"a KV cache of {kv} bytes holds {tokens} tokens, fewer than max_model_len "
                         f"({sched.max_model_len}); raise --kv-cache-memory-bytes to at least "
                         f"{kv_bytes_for_tokens(config, sched.max_model_len)} or lower --max-model-len")
    worker = WorkerMemory(weight_bytes(config), kv, runtime_bytes(config), tokens, config.cache.kv_offloading_bytes)
    if available is not None and processes * worker.total > USABLE_SHARE_OF_AVAILABLE * available:
        raise ValueError(f"{processes} CPU worker process(es) of {worker.describe()} each need "
                         f"{_gib(processes * worker.total)}, more than {USABLE_SHARE_OF_AVAILABLE:.0%} of this "
                         f"machine's available memory ({_gib(available)}); start fewer workers, lower "
                         "--max-model-len / --max-num-seqs / --max-num-batched-tokens, or use a smaller model")
    return worker


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable (the kernel's estimate of memory that can be allocated without swapping), or None where there
    is no /proc/meminfo."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # kB
    return None
