"""`EngineArgs`: the flat, user-facing engine arguments (vLLM's names, shared by `LLM(**kwargs)` and every CLI
command), their CLI flags (declared in engine/arg_flags.py), and their one conversion into the frozen
`EngineConfig` of engine/config.py.

`EngineArgs.create_engine_config()` validates and resolves every argument once (device, dtype, batch limits, the
model's architecture, quantization), so a bad argument fails with its reason before any model is loaded where that
can be known. This module's imports stay light at module level (the model loader and the tensor-parallel layout are
imported where the conversion needs them): every `kvflow` command, the router's included, registers these flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from engine.arg_flags import DTYPE_CHOICES, KV_CACHE_DTYPES, QUANTIZATION_METHODS, add_engine_args
from engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    GiB,
    ModelConfig,
    PreemptionMode,
    SchedulerConfig,
)
from engine.processing.generation_config import check_generation_config, parse_override
from engine.spec.config import SpecConfig
from engine.structured.config import StructuredOutputsConfig
from engine.structured.limits import DEFAULT_LIMITS, StructuredOutputLimits

if TYPE_CHECKING:
    from engine.models.arch import ModelArch
    from engine.models.loader import ResolvedModel

KV_OFFLOADING_BACKENDS = ("native", "lmcache")  # vLLM's choices; kvflow runs "native"
UsageContext = Literal["llm", "server"]
USAGE_CONTEXTS: tuple[str, ...] = get_args(UsageContext)
CPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_BATCHED_TOKENS = 8192


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_batch_limits(device: str, usage_context: str, total_memory_bytes: int | None,
                         device_name: str | None) -> tuple[int, int]:
    """Default (max_num_seqs, max_num_batched_tokens), following vLLM V1's `EngineArgs.get_batch_defaults`.

    Large GPUs (>= 70 GiB, e.g. H100/H200) get 1024 sequences and a bigger token budget for throughput; A100s
    keep the small defaults because big token budgets hurt them (vLLM PR #17885). The offline `LLM` class
    ("llm") gets a larger token budget than an API server ("server"), which favours inter-token latency.
    CPU keeps kvflow's fixed 256 / 8192 for both contexts.
    """
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {', '.join(map(repr, USAGE_CONTEXTS))}, "
                         f"got {usage_context!r}")
    if not device.startswith("cuda"):
        return CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS
    large = (total_memory_bytes is not None and total_memory_bytes >= 70 * GiB
             and "a100" not in (device_name or "").lower())
    if large:
        return 1024, 16384 if usage_context == "llm" else 8192
    return 256, 8192 if usage_context == "llm" else 2048


def device_batch_limits(device: str, usage_context: str) -> tuple[int, int]:
    """`default_batch_limits` for a resolved device, reading a CUDA device's total memory and name from torch."""
    if not device.startswith("cuda"):
        return default_batch_limits(device, usage_context, None, None)
    import torch

    props = torch.cuda.get_device_properties(device)
    return default_batch_limits(device, usage_context, props.total_memory, props.name)


def resolve_dtype(dtype: str, device: str) -> str:
    aliases = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}
    dtype = aliases.get(dtype, dtype)
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return dtype


def checkpoint_quantization(requested: str | None, hf_config: Any, device: str, dummy: bool = False) -> str | None:
    """The quantization to run: the flag, or what the checkpoint's `quantization_config` declares (as vLLM
    does). Checkpoint formats kvflow cannot run are refused here with the reason (never a missing-weight error
    at load). `dummy`: random weights, drawn in any method's layout (no checkpoint needed)."""
    qc = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = qc.get("quant_method")
    if method in ("awq", "gptq"):
        from engine.quant.awq_gptq import check_config

        check_config(method, qc)
        if requested not in (None, method):
            raise ValueError(f"the checkpoint is {method}-quantized; quantization={requested!r} does not apply to it")
        return method
    if requested in ("awq", "gptq") and not dummy:
        raise ValueError(f"quantization={requested!r} needs a {requested} checkpoint (config.json "
                         "quantization_config.quant_method), or load_format='dummy' for random int4 weights")
    if method is not None and method != "fp8":
        raise ValueError(f"unsupported checkpoint quantization {method!r} (quantization_config.quant_method); "
                         f"kvflow runs: {', '.join(QUANTIZATION_METHODS)}")
    if method == "fp8":
        if requested not in (None, "fp8"):
            raise ValueError(f"the checkpoint is fp8-quantized; quantization={requested!r} does not apply to it")
        requested = "fp8"
    if requested == "fp8" and not device.startswith("cuda"):
        raise ValueError("quantization='fp8' (W8A8 with torch._scaled_mm) needs a CUDA GPU (Hopper or newer); "
                         "on CPU use quantization='gguf' with a GGUF model")
    return requested


@dataclass
class EngineArgs:
    """vLLM-named engine arguments, shared by `LLM(...)` and every CLI command."""

    model: str = "smollm2"
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: by device and usage context (default_batch_limits)
    max_num_batched_tokens: int | None = None  # None: likewise
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    itl_target_ms: float | None = None  # None: off (prefill chunks are bounded by max_num_batched_tokens only)
    ttft_target_ms: float | None = None  # with itl_target_ms: the queued prompts' drain time that makes the cap yield
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out KV blocks
    cpu_offload_gb: float = 0.0  # GiB of weights in pinned host memory, streamed to the GPU per layer (CUDA only)
    kv_offloading_size: float | None = None  # GiB of host memory for evicted prefix-cache blocks; None: off
    kv_offloading_backend: str | None = None  # "native" (implied by kv_offloading_size); "lmcache" is refused
    load_format: str = "auto"
    generation_config: str = "auto"  # 'auto', 'vllm' or a folder holding generation_config.json
    override_generation_config: dict[str, Any] | None = None  # generation_config.json names, e.g. temperature
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # contiguous layer ranges per stage (engine/parallel/stages.py)
    enable_expert_parallel: bool = False  # MoE models: whole experts dealt out across the TP ranks
    enable_custom_all_reduce: bool = False  # small all-reduces one-shot over peer memory at any TP size on GPUs
    disable_custom_all_reduce: bool = False  # vLLM's flag: NCCL for every all-reduce (TP2/TP4 default: one-shot)
    cudagraph_capture_sizes: list[int] | None = None
    max_seq_len_to_capture: int = 8192
    disable_log_stats: bool = True
    quantization: str | None = None
    # Who runs the engine: the offline LLM class / bench / generate ("llm") or an API server's worker
    # ("server"); picks the batch defaults as vLLM's UsageContext does. Set in code, not a CLI flag.
    usage_context: UsageContext = "llm"
    # Speculative decoding (engine/spec/config.py): vLLM's dict / JSON, or its older flags below.
    speculative_config: dict[str, Any] | str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    speculative_disable_by_batch_size: int | None = None
    # Structured output (engine/structured/config.py): vLLM's dict / JSON, or its older backend flag.
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs_timeout_s: float = DEFAULT_LIMITS.timeout_s

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, default_log_stats: bool = False) -> None:
        add_engine_args(parser, EngineArgs(), default_log_stats=default_log_stats)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)})

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        from engine.models.loader import resolve_model

        self._validate()
        speculative = self.spec_config()  # a bad speculative config fails before any model is loaded
        structured_outputs = self.structured_outputs()  # likewise
        structured_output_limits = self.structured_output_limits()
        device = _resolve_device(self.device)
        self.validate_cpu_offload(device)
        self._validate_custom_all_reduce(device)
        dtype = resolve_dtype(self.dtype, device)
        resolved = resolve_model(self.model, self.load_format)
        self._validate_parallel_for(resolved.arch, speculative)
        max_model_len = self._max_model_len(resolved.arch)
        scheduler = self._scheduler_config(device, max_model_len)
        model = self._model_config(resolved, dtype, device, max_model_len)
        return EngineConfig(model, self._cache_config(), scheduler, self._device_config(device), speculative,
                            structured_outputs, structured_output_limits)

    def _validate_parallel_for(self, arch: ModelArch, speculative: SpecConfig | None) -> None:
        """The tensor- and pipeline-parallel sizes against this model, before any rank starts."""
        from engine.parallel.layout import validate_tp
        from engine.parallel.stages import validate_pp

        validate_tp(arch, self.tensor_parallel_size)
        validate_pp(arch.num_layers, self.pipeline_parallel_size)
        if self.pipeline_parallel_size > 1:
            from engine.models.registry import model_class

            if "stage" not in inspect.signature(model_class(arch.architecture)).parameters:
                raise ValueError(f"pipeline_parallel_size > 1 is not supported for {arch.architecture} yet (its model "
                                 "class builds every layer); use --pipeline-parallel-size 1")
        if self.pipeline_parallel_size > 1 and speculative is not None:
            raise ValueError("speculative decoding with pipeline_parallel_size > 1 is not supported (the draft "
                             "model and the verify step run on one rank); drop --pipeline-parallel-size or the "
                             "speculative config")
        if self.enable_expert_parallel and arch.moe is None:
            raise ValueError(f"enable_expert_parallel is not supported for {arch.architecture}: a dense model has no "
                             "experts to deal out; drop --enable-expert-parallel")
        if self.enable_expert_parallel and arch.moe is not None and arch.moe.num_experts < self.tensor_parallel_size:
            raise ValueError(f"enable_expert_parallel with tensor_parallel_size={self.tensor_parallel_size} needs at "
                             f"least one expert per rank; the model has {arch.moe.num_experts}")
        if self.tensor_parallel_size > 1 and speculative is not None:
            raise ValueError("speculative decoding with tensor_parallel_size > 1 is not supported yet (the draft "
                             "model and the verify step run on one rank)")

    def _max_model_len(self, arch: ModelArch) -> int:
        max_model_len = self.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({arch.max_position_embeddings})"
            )
        return max_model_len

    def _scheduler_config(self, device: str, max_model_len: int) -> SchedulerConfig:
        default_seqs, default_tokens = device_batch_limits(device, self.usage_context)
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else default_seqs
        if self.max_num_batched_tokens is not None:
            batched = self.max_num_batched_tokens
        else:
            batched = default_tokens if self.enable_chunked_prefill else max(max_model_len, default_tokens)
        if not self.enable_chunked_prefill and batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) < max_model_len ({max_model_len}) needs chunked prefill; "
                "enable it or raise max_num_batched_tokens"
            )
        return SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            itl_target_ms=self.itl_target_ms,
            ttft_target_ms=self.ttft_target_ms,
        )

    def _model_config(self, resolved: ResolvedModel, dtype: str, device: str, max_model_len: int) -> ModelConfig:
        model = ModelConfig(
            model=self.model,
            model_id=resolved.model_id,
            model_path=resolved.path,
            tokenizer_path=self.tokenizer or resolved.tokenizer_path,
            arch=resolved.arch,
            hf_config=resolved.hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            load_format=resolved.load_format,
            generation_config=self.generation_config,
            seed=self.seed,
            override_generation_config=parse_override(self.override_generation_config),
            quantization=checkpoint_quantization(self.quantization, resolved.hf_config, device,
                                                 dummy=resolved.load_format == "dummy"),
            gguf_file=resolved.gguf_file,
        )
        if self.cpu_offload_gb and model.quantization is not None:  # a quantized checkpoint picks it by itself
            raise ValueError(f"--cpu-offload-gb with a {model.quantization}-quantized model is not supported yet "
                             "(the quantized layers' packed weights are not streamed)")
        if self.quantization == "gguf" and resolved.gguf_file is None and resolved.load_format != "dummy":
            raise ValueError(f"quantization='gguf' needs a GGUF model (a .gguf file or 'smollm2') or "
                             f"load_format='dummy', got {self.model!r}")
        if resolved.arch.moe is not None:
            self._validate_moe(model)
        return model

    def _validate_moe(self, model: ModelConfig) -> None:
        """What an MoE model (engine/models/moe.py) does not run yet, refused naming the argument."""
        if model.quantization is not None:
            raise ValueError(f"quantization={model.quantization!r} with an MoE model ({model.arch.architecture}) is "
                             "not supported yet: the experts run unquantized; use an unquantized checkpoint")
        if self.cpu_offload_gb:
            raise ValueError(f"--cpu-offload-gb with an MoE model ({model.arch.architecture}) is not supported yet "
                             "(its layers differ in size); use --cpu-offload-gb 0")
        moe = model.arch.moe
        if moe is not None and not self.enable_expert_parallel and moe.expert_intermediate_size < \
                self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} slices each expert's "
                             f"{moe.expert_intermediate_size} intermediate rows too thin; use --enable-expert-parallel")

    def _cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space_bytes=int(self.swap_space * GiB),
            cpu_offload_bytes=int(self.cpu_offload_gb * GiB),
            kv_offloading_bytes=int(self.kv_offloading_size * GiB) if self.kv_offloading_size is not None else 0,
            kv_cache_dtype="fp8_e4m3" if self.kv_cache_dtype in ("fp8", "fp8_e4m3") else self.kv_cache_dtype,
        )

    def _device_config(self, device: str) -> DeviceConfig:
        return DeviceConfig(
            device=device,
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            custom_all_reduce=self._custom_all_reduce(device),
            cudagraph_capture_sizes=tuple(self.cudagraph_capture_sizes) if self.cudagraph_capture_sizes else None,
            max_seq_len_to_capture=self.max_seq_len_to_capture,
        )

    def spec_config(self) -> SpecConfig | None:
        """The speculative decoding config from `speculative_config` or the older flags (not both)."""
        legacy = SpecConfig.from_legacy(self.speculative_model, self.num_speculative_tokens,
                                        self.ngram_prompt_lookup_max, self.ngram_prompt_lookup_min,
                                        self.speculative_disable_by_batch_size)
        spec = SpecConfig.parse(self.speculative_config)
        if spec is not None and legacy is not None:
            raise ValueError("give speculative_config or the older --speculative-model flags, not both")
        return spec or legacy

    def structured_outputs(self) -> StructuredOutputsConfig:
        """The structured-output config from `structured_outputs_config` and `guided_decoding_backend`; raises
        ValueError naming the flag (cheap: `kvflow serve` checks it before starting any worker), as it does for
        `--structured-outputs-timeout-s`."""
        self.structured_output_limits()
        return StructuredOutputsConfig.parse(self.structured_outputs_config, self.guided_decoding_backend)

    def structured_output_limits(self) -> StructuredOutputLimits:
        """The compile budget from `--structured-outputs-timeout-s`, with the fixed size limits."""
        return dataclasses.replace(DEFAULT_LIMITS, timeout_s=self.structured_outputs_timeout_s)

    def without_speculation(self) -> EngineArgs:
        """The same arguments with speculation off (prefill workers never decode past the first token)."""
        return dataclasses.replace(self, speculative_config=None, speculative_model=None,
                                   num_speculative_tokens=None, ngram_prompt_lookup_max=None,
                                   ngram_prompt_lookup_min=None, speculative_disable_by_batch_size=None)

    def _validate(self) -> None:
        checks = [
            (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size must be a power of 2"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
             "num_gpu_blocks_override must be >= 2"),
            (self.swap_space >= 0, "swap_space must be >= 0"),
            (self.quantization is None or self.quantization in QUANTIZATION_METHODS,
             f"unsupported quantization {self.quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}"),
            (self.quantization is None or self.tensor_parallel_size == 1,
             "quantization with tensor_parallel_size > 1 is not supported yet (the quantized layers are not sharded)"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"),
            (self.usage_context in USAGE_CONTEXTS,
             f"usage_context must be 'llm' or 'server', got {self.usage_context!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_generation_config(self.generation_config)
        self.validate_itl_target()
        self.validate_ttft_target()
        self.validate_kv_offloading()
        self.validate_parallel()

    def validate_itl_target(self) -> None:
        """itl_target_ms (--itl-target-ms): positive when set, and only with chunked prefill (without it a prompt
        is never split, so a cap could only stall it)."""
        target = self.itl_target_ms
        if target is None:
            return
        if not target > 0 or target == float("inf"):
            raise ValueError(f"--itl-target-ms must be a positive number of milliseconds, got {target:g}")
        if not self.enable_chunked_prefill:
            raise ValueError("--itl-target-ms needs chunked prefill (it caps prefill chunks); drop "
                             "--no-enable-chunked-prefill or --itl-target-ms")

    def validate_ttft_target(self) -> None:
        """ttft_target_ms (--ttft-target-ms): positive when set, and only beside --itl-target-ms (it says when
        that cap yields; alone it would do nothing)."""
        target = self.ttft_target_ms
        if target is None:
            return
        if not target > 0 or target == float("inf"):
            raise ValueError(f"--ttft-target-ms must be a positive number of milliseconds, got {target:g}")
        if self.itl_target_ms is None:
            raise ValueError("--ttft-target-ms only says when the --itl-target-ms cap yields: give both, or neither")

    def validate_kv_offloading(self) -> None:
        """kv_offloading_size / kv_offloading_backend (cheap: `kvflow serve` checks them before starting a worker)."""
        size, backend = self.kv_offloading_size, self.kv_offloading_backend
        if backend is not None and backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend (--kv-offloading-backend) must be 'native', got {backend!r}")
        if backend == "lmcache":
            raise ValueError("kv_offloading_backend='lmcache' is not supported by kvflow (LMCache is an external "
                             "service); use --kv-offloading-backend native")
        if size is None:
            if backend is not None:
                raise ValueError("--kv-offloading-backend needs --kv-offloading-size (GiB of host memory), as in vLLM")
            return
        if not 0 < size < float("inf"):
            raise ValueError(f"kv_offloading_size (--kv-offloading-size) must be a positive number of GiB, got {size:g}")
        if not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size keeps evicted prefix-cache blocks: it needs prefix caching (drop "
                             "--no-enable-prefix-caching)")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"--kv-offloading-size with --tensor-parallel-size {self.tensor_parallel_size} is not "
                             "supported yet (one host tier per rank); use one of them")
        spec = self.spec_config()
        if spec is not None and spec.method == "draft_model":
            raise ValueError("--kv-offloading-size with a draft-model speculative_config is not supported yet (the "
                             "draft's KV cache has no host tier); use ngram speculation or no offloading")

    def _custom_all_reduce(self, device: str) -> bool:
        """Whether the TP group's small all-reduces go one-shot over peer memory: asked for, or by default at TP2
        and TP4 on CUDA. TP2 measured it faster end to end (bench/results/tp_peer_decode8b_h200.json); TP4 measured
        it 2.4x faster at decode sizes and token-exact (tp_allreduce_tp4.json, tp_check_tp4.json). Other sizes keep
        NCCL until measured. Set-up falls back to NCCL where peer memory is missing (Info.all_reduce)."""
        if self.disable_custom_all_reduce:
            return False
        return self.enable_custom_all_reduce or (device.startswith("cuda") and self.tensor_parallel_size in (2, 4))

    def _validate_custom_all_reduce(self, device: str) -> None:
        """The peer-memory all-reduce is GPU memory shared between processes: refused where it could not run."""
        if not self.enable_custom_all_reduce:
            return
        if self.disable_custom_all_reduce:
            raise ValueError("--enable-custom-all-reduce and --disable-custom-all-reduce contradict each other: pass "
                             "one")
        if not device.startswith("cuda"):
            raise ValueError(f"--enable-custom-all-reduce needs CUDA GPUs (device is {device!r}): CPU ranks sum over "
                             "gloo; drop the flag")

    def validate_cpu_offload(self, device: str | None = None) -> None:
        """cpu_offload_gb against the device (cheap: `kvflow serve` checks it before starting any worker)."""
        gb = self.cpu_offload_gb
        if not gb >= 0:
            raise ValueError(f"cpu_offload_gb (--cpu-offload-gb) must be >= 0, got {gb:g}")
        if gb == 0:
            return
        device = _resolve_device(self.device) if device is None else device
        if not device.startswith("cuda"):
            raise ValueError(f"--cpu-offload-gb {gb:g} needs a CUDA GPU (device is {device!r}): it moves weights from "
                             "GPU memory to host memory, and on the CPU every weight is in host memory already; "
                             "use --cpu-offload-gb 0")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"--cpu-offload-gb with --tensor-parallel-size {self.tensor_parallel_size} is not "
                             "supported yet (each rank would stream its own shard); use one of them")
        if self.quantization is not None:
            raise ValueError(f"--cpu-offload-gb with quantization={self.quantization!r} is not supported yet (the "
                             "quantized layers' packed weights are not streamed); use one of them")

    def validate_parallel(self) -> None:
        """The parallel layout alone (cheap: `kvflow serve` checks it before starting any worker)."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size (--pipeline-parallel-size) must be >= 1, got {pp}")
        if pp > 1 and self.quantization is not None:
            raise ValueError(f"--pipeline-parallel-size {pp} with quantization={self.quantization!r} is not "
                             "supported yet (the quantized loaders build every layer); use one of them")
        if pp > 1 and self.kv_cache_dtype != "auto":
            raise ValueError(f"--pipeline-parallel-size {pp} with kv_cache_dtype={self.kv_cache_dtype!r} is not "
                             "supported yet (per-stage fp8 KV scales); use --kv-cache-dtype auto")
        if pp > 1 and self.kv_offloading_size is not None:
            raise ValueError(f"--kv-offloading-size with --pipeline-parallel-size {pp} is not supported yet (each "
                             "stage would need a host tier of its own layers); use one of them")
        if pp > 1 and self.cpu_offload_gb:
            raise ValueError(f"--cpu-offload-gb with --pipeline-parallel-size {pp} is not supported (each stage "
                             "already holds only its layers); use one of them")
