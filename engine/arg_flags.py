"""The CLI flags of `EngineArgs` (vLLM's spellings, in one argparse group) and the choices they offer.

Every `kvflow` command registers these flags (the router's included), so this module imports nothing heavy: the
defaults come from an `EngineArgs()` that engine/arg_utils.py passes in.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.processing.generation_config import parse_override
from engine.structured.config import BACKENDS as STRUCTURED_OUTPUT_BACKENDS
from engine.structured.limits import DEFAULT_LIMITS

QUANTIZATION_METHODS = ("gguf", "fp8", "awq", "gptq")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16")


def _override_arg(text: str) -> dict[str, Any] | None:
    """--override-generation-config: argparse prints our reason, not "invalid value"."""
    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser, d: Any, *, default_log_stats: bool = False) -> None:
    """The engine's flags on `parser`, with `d`'s values as their defaults: `d` is an `EngineArgs()` (passed in,
    so that this module need not import engine/arg_utils.py, which imports it)."""
    g = parser.add_argument_group("engine arguments (vLLM names)")
    g.add_argument("--model", default=d.model, help="HF directory, .gguf file, preset, or 'smollm2'")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPE_CHOICES,
                   help="weights and activations: auto is bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--seed", type=int, default=d.seed, help="random seed of the engine (sampling, dummy weights)")
    g.add_argument("--device", default=d.device, help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block (a power of 2)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="share of the GPU's memory the worker may use, KV cache included (CUDA)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache size in bytes, per worker (per rank). Default: on CUDA, what is left of the "
                        "--gpu-memory-utilization share after profiling; on CPU, 4 GiB, except under `kvflow "
                        "serve`, which sizes it from the model and the host's available memory "
                        "(engine/process/memory_budget.py)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache blocks, overriding the size from memory (CPU too)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt and output (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: by device and usage, as vLLM (1024 on >= 70 GiB GPUs, else 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: by device and usage, as vLLM (16384 offline / 8192 server on >= 70 GiB "
                        "GPUs; 8192 / 2048 on smaller GPUs; 8192 on CPU)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes seen before")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over steps of at most --max-num-batched-tokens")
    g.add_argument("--preemption-mode", choices=("recompute", "swap"), default=d.preemption_mode,
                   help="when the KV cache is full, a preempted request is recomputed later or swapped to "
                        "--swap-space")
    g.add_argument("--itl-target-ms", type=float, default=None,
                   help="when requests are decoding, prefill tokens per step are capped so that a step is "
                        "predicted (from measured step times) to take at most this many milliseconds; steps "
                        "without decodes are not capped. Needs chunked prefill. Off by default")
    g.add_argument("--ttft-target-ms", type=float, default=None,
                   help="with --itl-target-ms: when the prompt tokens queued on this engine would not all be "
                        "prefilled within this many milliseconds at the capped rate, the cap yields to the chunk "
                        "size that does (up to --max-num-batched-tokens): waiting prompts' TTFT is traded against "
                        "the decodes' gaps. Off by default (the cap never yields)")
    g.add_argument("--swap-space", type=float, default=d.swap_space, help="GiB of CPU swap space")
    g.add_argument("--cpu-offload-gb", type=float, default=d.cpu_offload_gb,
                   help="GiB of the model's weights (whole decoder layers, first layers first) kept in pinned "
                        "CPU memory and copied to the GPU layer by layer in every forward: more room for the KV "
                        "cache, or a model larger than the GPU, at the cost of PCIe traffic per step. CUDA only")
    g.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of host memory (pinned beside a GPU) for KV blocks evicted from the prefix cache: "
                        "they are copied there first, and a later prompt with that prefix loads them back "
                        "instead of recomputing them; least recently used blocks leave first. Off by default")
    g.add_argument("--kv-offloading-backend", default=None, metavar="{native}",
                   help="native (the default once --kv-offloading-size is set): kvflow's own host tier")
    g.add_argument("--load-format", choices=("auto", "safetensors", "gguf", "dummy"), default="auto",
                   help="dummy: random weights (benchmarks, tests)")
    g.add_argument("--generation-config", default=d.generation_config,
                   help="'auto' (the model's generation_config.json), 'vllm' (none) or a folder holding one")
    g.add_argument("--override-generation-config", type=_override_arg, default=None,
                   help="JSON object merged over the generation config, e.g. '{\"temperature\": 0.5}'; "
                        "max_new_tokens caps every request's max_tokens")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model dtype; fp8 (= fp8_e4m3): e4m3 with a per-tensor scale")
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="gguf: keep a GGUF model's Q4_0/Q4_1/Q8_0 weights quantized (default: dequantized); "
                        "fp8: W8A8 on CUDA (online from bf16/fp16, or an fp8 checkpoint); awq / gptq: 4-bit "
                        "checkpoints (selected from their config anyway); with --load-format dummy, random weights "
                        "in the method's layout")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs (or CPU processes) per worker, one process per rank (Megatron-style splits)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages per worker: contiguous decoder-layer ranges, one process per stage "
                        "(times --tensor-parallel-size)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: deal whole experts out across the --tensor-parallel-size ranks (attention "
                        "stays tensor-parallel; each rank's expert outputs are summed by one all-reduce)")
    g.add_argument("--enable-custom-all-reduce", action="store_true",
                   help="tensor parallelism on GPUs: all-reduces up to 4 MiB go one-shot over peer GPU memory "
                        "at any --tensor-parallel-size (the default at 2, where it was measured faster end to end; "
                        "NCCL at other sizes otherwise)")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="(vLLM) every all-reduce on NCCL, at every --tensor-parallel-size")
    g.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None,
                   help="decode batch sizes captured as CUDA graphs (default: by --max-num-seqs, as vLLM)")
    g.add_argument("--max-seq-len-to-capture", type=int, default=d.max_seq_len_to_capture,
                   help="longer sequences decode without CUDA graphs")
    g.add_argument("--disable-log-stats", action="store_true", default=not default_log_stats,
                   help="no periodic engine stats line")
    g.add_argument("--speculative-config", default=None,
                   help='JSON, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": '
                        '4}\' or \'{"model": "smollm2", "num_speculative_tokens": 3}\'')
    g.add_argument("--speculative-model", default=None, help="(older vLLM form) draft model, or '[ngram]'")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="(older vLLM form) tokens proposed per step")
    g.add_argument("--ngram-prompt-lookup-max", type=int, default=None,
                   help="(older vLLM form) longest n-gram matched in the prompt")
    g.add_argument("--ngram-prompt-lookup-min", type=int, default=None,
                   help="(older vLLM form) shortest n-gram matched in the prompt")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="(older vLLM form) no speculation while this many requests run")
    # No argparse `choices` here: a refused backend gets one line with the reason (structured_outputs()), not
    # argparse's usage text.
    g.add_argument("--structured-outputs-config", default=None,
                   help='JSON, as vLLM: \'{"backend": "xgrammar", "disable_any_whitespace": true}\'; backend '
                        f'{" or ".join(STRUCTURED_OUTPUT_BACKENDS)} (both xgrammar), disable_any_whitespace '
                        "(compact JSON for every request), disable_fallback (there is no other backend)")
    g.add_argument("--guided-decoding-backend", default=None,
                   metavar="{" + ",".join(STRUCTURED_OUTPUT_BACKENDS) + "}",
                   help="(older vLLM form) the structured-output backend: xgrammar, kvflow's only one")
    g.add_argument("--structured-outputs-timeout-s", type=float, default=DEFAULT_LIMITS.timeout_s,
                   help="seconds one request's grammar (JSON schema, regex, grammar, tool schema) may take to "
                        "compile, off the engine loop; a slower one is refused with a 400 naming the field")
