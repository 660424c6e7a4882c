"""The engine's frozen configuration, one dataclass per concern, composed into `EngineConfig`.

Data only: `engine/arg_utils.py` builds these from the user's `EngineArgs` (resolving and validating every value
once); the engine, the runner, the scheduler and the tensor-parallel ranks only read them. Values known only after
profiling (the KV block count) are returned by the runner, never written back here. This module imports no model,
loader, parallel or kernel code, so the router and the CLI can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engine.spec.config import SpecConfig
from engine.structured.config import StructuredOutputsConfig
from engine.structured.limits import StructuredOutputLimits

if TYPE_CHECKING:  # a type only: the router, which imports this module, loads nothing of engine/models
    from engine.models.arch import ModelArch

GiB = 1 << 30
PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user asked for: a preset, a path or a built-in name
    model_id: str  # stable identity used to seed block hashes
    model_path: str | None  # resolved HF directory (None for dummy presets)
    tokenizer_path: str | None
    arch: ModelArch
    hf_config: Any = field(compare=False, repr=False)
    dtype: str = "float32"  # resolved torch dtype name
    max_model_len: int = 2048
    load_format: str = "auto"
    generation_config: str = "auto"
    seed: int = 0
    override_generation_config: dict[str, Any] | None = field(default=None, compare=False)
    quantization: str | None = None  # arg_utils.QUANTIZATION_METHODS; None: the checkpoint's own dtype
    gguf_file: str | None = None  # the source .gguf of a GGUF model (read directly by --quantization gguf)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 4 * GiB
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8_e4m3" (aliases resolved)
    cpu_offload_bytes: int = 0  # weights kept in pinned host memory, streamed per layer (engine/runner/weight_offload.py)
    # --kv-offloading-size: the host KV tier's bytes (engine/core/host_tier.py); 0: off. Backend "native" only.
    kv_offloading_bytes: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    # --itl-target-ms: while requests decode, cap a step's prefill tokens so that the step is predicted to take at
    # most this long (engine/core/step_budget.py). None: off. Needs chunked prefill.
    itl_target_ms: float | None = None
    # --ttft-target-ms (with itl_target_ms): the cap yields when the prompt tokens queued here would not all be
    # prefilled within this long at the capped rate; chunks then grow to the rate that does (or to
    # max_num_batched_tokens). Waiting prompts' TTFT is weighed against the decodes' gaps. None: the cap never yields.
    ttft_target_ms: float | None = None


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of contiguous decoder layers (engine/parallel/stages.py)
    enable_expert_parallel: bool = False  # MoE: whole experts dealt out across the tensor-parallel ranks
    # GPUs: small tensor-parallel all-reduces (up to 4 MiB at TP2, 2 MiB at TP4) go one-shot over peer memory
    # (engine/parallel/peer_all_reduce.py) instead of NCCL. EngineArgs turns it on for TP2 and TP4 on CUDA (measured
    # faster there) unless --disable-custom-all-reduce; other TP sizes only with --enable-custom-all-reduce
    custom_all_reduce: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_seq_len_to_capture: int = 8192


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    speculative: SpecConfig | None = None  # engine/spec/config.py; the draft's vocabulary is checked at load
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    structured_output_limits: StructuredOutputLimits = field(default_factory=StructuredOutputLimits)

