"""Model runner: owns the device, the weights and the KV cache; turns a `SchedulerOutput` into sampled tokens.

It keeps per-request sampling state (sent once as `NewRequestData`) and gets only token ids, positions and
block tables each step.

On CUDA the model is built in place on the GPU in its dtype, uses the Triton kernels (attention backend and fused
layer ops), replays decode-only steps from CUDA graphs (forward, lm_head and greedy argmax in one replay), and sizes
the KV cache from a memory profile. The CPU path keeps plain torch ops (the numerics tested token-exact against
transformers).

Decode-ahead (CUDA graphs, all-greedy batches, grammar-constrained rows included): after a decode step the runner
queues the replay of the step it expects next (same requests, each one position further, fed this step's argmax,
grammar-masked where a request has a grammar, on the device) before it waits for this step's ids. The GPU then
runs step n+1 while the host finishes step n and schedules n+1. The next call uses
that replay only if the scheduler asks for exactly that step (same requests in the same order, the predicted
positions, tokens and KV slots); otherwise it is dropped. A dropped replay only wrote K/V at a slot the request
itself owns, one past its context, which the real next write of that slot replaces.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.config import EngineConfig
from engine.models.llama import CausalLM, DecoderLayer
from engine.models.loader import hf_state_dict
from engine.models.registry import model_class
from engine.outputs import (
    ModelRunnerOutput,
    NewRequestData,
    PositionLogprobs,
    ScheduledChunk,
    SchedulerOutput,
)
from engine.parallel.group import TPGroup
from engine.parallel.layout import RankShard, shard_for
from engine.parallel.sharding import init_dummy_sharded, load_sharded_state
from engine.quant.kv_fp8 import DEFAULT_KV_SCALES, checkpoint_kv_scales
from engine.runner.attention import AttentionBackend, AttentionBatch, KVCache, TorchPagedAttention
from engine.runner.cpu_linear import pack_linears_for_cpu
from engine.runner.cpu_memory import keep_freed_memory_for_reuse
from engine.runner.cuda_graphs import DecodeGraphs, DecodeResult, capture_sizes
from engine.runner.sampler import GrammarMask, Sampler, SamplingRow, gather_logprobs
from engine.runner.weight_offload import LayerWeightStream, OffloadPlan, parameter_bytes, plan_offload
from engine.sampling_params import SamplingParams
from engine.spec.rejection_sampler import verify_greedy
from engine.spec.verify import verify_spans
from engine.structured.grammar import StructuredOutputManager
from kernels._triton import HAS_TRITON

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 4 << 30  # vLLM's CPU backend default KV space
AHEAD_MIN_SCORE = 0.3  # two misses in a row from a clean record stop decode-ahead ...
AHEAD_RECOVERY = 0.02  # ... for about 10 eligible steps


def select_attention_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """Triton kernels on CUDA (when Triton is installed), the torch backend everywhere else."""
    if device.type == "cuda":
        if HAS_TRITON:
            from engine.runner.attention_triton import TritonPagedAttention

            return TritonPagedAttention(block_size)
        logger.warning("Triton is not installed: CUDA runs the torch attention backend and no CUDA graphs")
    return TorchPagedAttention(block_size)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are allocated directly in `dtype` (no fp32 copy of a large model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _set_kv_scales(model: CausalLM, model_path: str | None) -> None:
    """fp8 KV cache: each layer's calibrated (k_scale, v_scale) from the checkpoint, else 1.0 (engine/quant/kv_fp8.py)."""
    layers = model.layers
    scales = checkpoint_kv_scales(model_path, len(layers))
    for layer, pair in zip(layers, scales or [DEFAULT_KV_SCALES] * len(layers), strict=True):
        layer.self_attn.kv_scales = pair
    if scales is None:
        logger.info("fp8 KV cache: the checkpoint calibrates no KV scales; k_scale = v_scale = 1.0")
    else:
        ks, vs = [k for k, _ in scales], [v for _, v in scales]
        logger.info("fp8 KV cache: per-layer scales from the checkpoint (k_scale %.3g-%.3g, v_scale %.3g-%.3g)",
                    min(ks), max(ks), min(vs), max(vs))


def _log_offload(plan: OffloadPlan) -> None:
    gib = 2**30
    logger.info("cpu offload: layers 0-%d of %d (%.2f GiB) in pinned host memory, copied per forward (one layer "
                "ahead, on a copy stream) through %.2f GiB of staging buffers: %.2f GiB of GPU memory freed",
                plan.num_layers - 1, plan.total_layers, plan.offloaded_bytes / gib, plan.staging_bytes / gib,
                plan.gpu_bytes_saved / gib)
    if plan.gpu_bytes_saved <= 0:
        logger.warning("cpu_offload_gb covers %d layer(s), which frees no GPU memory (the two staging buffers are "
                       "a layer each): offload at least three layers' worth (%.2f GiB) or none", plan.num_layers,
                       3 * plan.layer_bytes / gib)


def _pinned_to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync: the host keeps queueing work while the copy runs."""
    return torch.from_numpy(array).pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class GpuMemory:
    """The current device's memory as this process sees it: free and total (all processes), torch's reserve."""

    free: int
    total: int
    reserved: int

    @classmethod
    def now(cls) -> GpuMemory:
        free, total = torch.cuda.mem_get_info()
        return cls(free, total, torch.cuda.memory_reserved())

    @property
    def used_by_others(self) -> int:
        """At start (before this process allocated anything): memory other processes and this CUDA context hold."""
        return self.total - self.free - self.reserved

    def check_share(self, utilization: float, device: torch.device) -> None:
        """vLLM's start-up check: this worker's share must be free now, or it fails saying what is in use."""
        share = self.total * utilization
        if self.free < share:
            raise ValueError(
                f"Free memory on {device} at startup ({self.free / 2**30:.2f} of {self.total / 2**30:.2f} GiB) is "
                f"less than this worker's share, gpu_memory_utilization={utilization} ({share / 2**30:.2f} GiB): "
                f"{self.used_by_others / 2**30:.2f} GiB are in use by other processes (e.g. another worker on "
                "this GPU) and this CUDA context. --gpu-memory-utilization is each worker's share of the GPU's "
                "total memory, as in vLLM: lower it so the shares of all processes on the GPU add up to at most "
                "about 0.9, or free the GPU.")


@dataclass
class RunnerRequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: Any = None  # xgrammar GrammarMatcher of a structured-output request

    def record(self, token: int) -> None:
        self.output_token_ids.append(token)
        if self.matcher is not None:
            self.matcher.accept_token(token)


@dataclass
class AheadStep:
    """A decode replay queued before the scheduler asked for it, and the step it assumed."""

    request_ids: list[str]
    positions: list[int]
    slot_blocks: list[int]  # the block holding each row's new KV
    result: DecodeResult
    tokens: list[int] = field(default_factory=list)  # the fed ids, known on the host once the step before returns

    def matches(self, chunks: list[ScheduledChunk], block_size: int) -> bool:
        if len(chunks) != len(self.request_ids):
            return False
        for chunk, rid, pos, blk, tok in zip(chunks, self.request_ids, self.positions, self.slot_blocks,
                                             self.tokens, strict=True):
            if (chunk.request_id != rid or chunk.start_position != pos or chunk.token_ids[0] != tok
                    or chunk.block_ids[pos // block_size] != blk):
                return False
        return True


def _greedy_argmax(state: RunnerRequestState) -> bool:
    """A request whose next token is the argmax of its logits, grammar-masked if it has a grammar: nothing on
    the host (penalties' history, logprobs) stands between one step's logits and the next step's input."""
    params = state.params
    return params.is_greedy and not params.needs_penalties and not params.logit_bias and params.logprobs is None


def _plain_greedy(state: RunnerRequestState) -> bool:
    """A request whose next token is the raw logits' argmax (what a decode graph computes itself)."""
    return _greedy_argmax(state) and state.matcher is None


@dataclass
class DecodeRows:
    """A step's chunks laid out as one query row per token, each attending to its own prefix of its sequence (the
    decode kernel's shape): how a speculative verify step replays a decode CUDA graph. Row r of a chunk starting at
    position p is position p + r with context p + r + 1; the KV-write kernel stores every row's K/V before the
    attention kernel reads, so row r sees rows 0..r-1 of this step exactly as the extend path would."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    spec_spans: list[tuple[str, int, list[int]]]  # (request, first verify row, drafts)
    sample_rows: list[int]  # chunks without drafts: their last row samples
    sample_ids: list[str]


def expand_to_decode_rows(chunks: list[ScheduledChunk], block_size: int) -> DecodeRows:
    rows = DecodeRows([], [], [], [], [], [], [], [])
    for chunk in chunks:
        first = len(rows.positions)
        n = len(chunk.token_ids)
        for offset in range(n):
            pos = chunk.start_position + offset
            rows.positions.append(pos)
            rows.slots.append(chunk.block_ids[pos // block_size] * block_size + pos % block_size)
            rows.seq_lens.append(pos + 1)
            rows.block_tables.append(chunk.block_ids)
        rows.input_ids.extend(chunk.token_ids)
        if chunk.spec_token_ids:
            rows.spec_spans.append((chunk.request_id, first + n - 1 - len(chunk.spec_token_ids), chunk.spec_token_ids))
        else:
            rows.sample_rows.append(first + n - 1)
            rows.sample_ids.append(chunk.request_id)
    return rows


class ModelRunner:
    """One rank's runner; with `tp_group` (tensor parallelism, engine/parallel/) it holds and computes only this
    rank's shard, and every rank runs the same steps (engine/parallel/executor.py)."""

    def __init__(self, config: EngineConfig, tp_group: TPGroup | None = None) -> None:
        self.config = config
        self.tp_group = tp_group
        self.shard = shard_for(config.model.arch, tp_group.rank, tp_group.size) if tp_group is not None \
            else RankShard.full(config.model.arch)
        self.device = torch.device(config.device.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device, by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[config.model.dtype]
        # KV cache dtype: the model's, or fp8 e4m3 (per-tensor scales on the attention backend, engine/quant/kv_fp8.py)
        self.kv_dtype = torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8_e4m3" else self.dtype
        self.kv_dtype_name = str(self.kv_dtype).removeprefix("torch.")
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.on_cuda = self.device.type == "cuda"
        self.memory_at_start: GpuMemory | None = None
        if self.on_cuda:
            torch.cuda.set_device(self.device)  # this thread; the engine thread binds itself too (bind_thread)
            self.memory_at_start = GpuMemory.now()
            if config.cache.kv_cache_memory_bytes is None and config.cache.num_gpu_blocks_override is None:
                self.memory_at_start.check_share(config.cache.gpu_memory_utilization, self.device)
        self.attn_backend = select_attention_backend(self.device, self.block_size)
        fused = self.on_cuda and HAS_TRITON
        started = time.perf_counter()
        torch.manual_seed(config.model.seed)
        # On CUDA every tensor is created on the GPU in the model dtype (an 8B model never touches the CPU).
        build_dtype = self.dtype if self.on_cuda else torch.get_default_dtype()
        offload = self._offload_plan(fused)
        with torch.device(self.device), default_dtype(build_dtype):
            model = model_class(arch.architecture)(
                arch, config.model.hf_config, self.attn_backend, config.model.max_model_len, fused_ops=fused,
                shard=self.shard, group=tp_group, host_layers=offload.num_layers)
        if offload.num_layers:  # before loading: the offloaded layers' weights go straight to pinned host memory
            model.weight_stream = LayerWeightStream(model.layers[: offload.num_layers], self.device)
        if config.model.quantization is not None:
            from engine.quant.loading import load_quantized

            load_quantized(model, config.model)
        elif config.model.load_format == "dummy" and tp_group is not None:
            init_dummy_sharded(model, config.model.seed, arch, self.shard)
        elif config.model.load_format == "dummy":
            model.init_dummy_weights(config.model.seed, self.device)
        elif tp_group is not None:
            assert config.model.model_path is not None
            model.load_hf_state_dict(load_sharded_state(config.model.model_path, arch, self.shard))
        else:
            assert config.model.model_path is not None
            model.load_hf_state_dict(hf_state_dict(config.model.model_path))
        if self.kv_dtype == torch.float8_e4m3fn:
            _set_kv_scales(model, config.model.model_path if config.model.load_format != "dummy" else None)
        if model.weight_stream is not None:
            model.weight_stream.activate()
            _log_offload(offload)
        if self.on_cuda:
            self.model = model.eval()  # already in dtype; the rotary tables stay fp32 as built
            torch.cuda.synchronize(self.device)  # the load time logged below includes the device work
        else:
            self.model = model.to(self.dtype).eval()
            if self.dtype == torch.float32:
                pack_linears_for_cpu(self.model, batch_hint=min(config.scheduler.max_num_seqs, 128))
            keep_freed_memory_for_reuse()
            self.model.rotary.to(torch.float32)  # cos/sin cache stays fp32, cast per use
        logger.info("loaded %s (%.1fM params, %s) in %.1fs", config.model.model, arch.num_params / 1e6,
                    config.model.dtype, time.perf_counter() - started)
        self.sampler = Sampler(config.model.seed, self.device)
        self.structured_output: StructuredOutputManager | None = None  # the engine sets it (it owns the tokenizer)
        self.requests: dict[str, RunnerRequestState] = {}
        self.kv_caches: list[KVCache] = []
        self.swap_caches: list[KVCache] = []
        self.graph_sizes = capture_sizes(config.scheduler.max_num_seqs, config.device.cudagraph_capture_sizes,
                                         config.device.enforce_eager) if fused else []
        self.graphs: DecodeGraphs | None = None
        self._step_done = torch.cuda.Event() if self.on_cuda else None
        self.ahead: AheadStep | None = None
        # Share of recent decode-ahead replays that were used; below AHEAD_MIN_SCORE the runner stops queueing
        # them (each miss costs one step of GPU time) and creeps back by AHEAD_RECOVERY per eligible step.
        self.ahead_score = 1.0
        self.ahead_hits = 0
        self.ahead_misses = 0

    @property
    def kv_scales(self) -> tuple[float, ...]:
        """fp8 cache: each layer's k_scale, v_scale in order (part of the KV layout P/D peers must share)."""
        if self.kv_dtype != torch.float8_e4m3fn:
            return ()
        return tuple(s for layer in self.model.layers for s in layer.self_attn.kv_scales)

    def _offload_plan(self, fused: bool) -> OffloadPlan:
        """The leading layers `cpu_offload_bytes` puts in host memory (engine/runner/weight_offload.py); sized from a layer
        built on the meta device, so it is exact for this model, dtype and shard."""
        budget = self.config.cache.cpu_offload_bytes
        num_layers = self.config.model.arch.num_layers
        if not budget:
            return OffloadPlan(0, 0, num_layers)
        if not self.on_cuda or self.tp_group is not None:  # EngineArgs refuses these first, naming the flag
            raise ValueError("cpu_offload_gb needs a single-GPU runner on CUDA")
        with torch.device("meta"), default_dtype(self.dtype):
            probe = DecoderLayer(self.config.model.arch, self.attn_backend, fused, self.shard)
        return plan_offload(budget, parameter_bytes(probe), num_layers)

    def check_ranks(self) -> None:
        """Raise if a tensor-parallel rank is gone (a single rank has none to lose)."""

    def shutdown(self) -> None:
        """Stop what the runner started (tensor-parallel ranks); nothing for a single rank."""

    def release_graphs(self) -> None:
        """Drop the decode graphs (and a replay queued ahead) once the GPU is done with them. An NCCL
        communicator whose collectives a live graph still holds hangs in ncclCommAbort, so tensor-parallel ranks
        call this before closing their group."""
        self.ahead = None
        if self.graphs is not None:
            self.graphs = None
            if self.on_cuda:
                torch.cuda.synchronize(self.device)

    # ---- KV cache ----------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its KV heads only)."""
        arch = self.config.model.arch
        return self.block_size * 2 * arch.num_layers * self.shard.num_kv_heads * arch.head_dim * self.kv_dtype.itemsize

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget (or the override); a value, never written back into config."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        else:
            budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds fewer than 2 blocks of {self.block_bytes}")
        if self.on_cuda:
            max_len = self.config.model.max_model_len
            logger.info("GPU KV cache: %d blocks (%.2f GiB, %d tokens); max concurrency %.2fx at %d tokens per "
                        "request", num_blocks, num_blocks * self.block_bytes / 2**30, num_blocks * self.block_size,
                        (num_blocks - 1) * self.block_size / max_len, max_len)
        return num_blocks

    def _profile_free_gpu_memory(self) -> int:
        """Bytes left for KV under vLLM's rule: `gpu_memory_utilization` is this worker's share of the GPU's total
        memory. From that share it subtracts what this process added since it started (weights, memory outside
        torch's allocator such as kernels' modules), the peak activations of the largest step (a
        max_num_batched_tokens prefill, then logits and the sampler's sort for max_num_seqs rows) and the decode
        graphs' pool (a decode forward, logits and argmax at the largest capture size). Other processes on the
        GPU are not counted against it: they have their own shares (checked at start)."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        assert self.memory_at_start is not None  # set in __init__ on CUDA
        tokens = sched.max_num_batched_tokens
        per_seq = min(tokens, self.config.model.max_model_len)
        lens = [per_seq] * (tokens // per_seq) + ([tokens % per_seq] if tokens % per_seq else [])
        graph_batch = max(self.graph_sizes, default=0)
        num_blocks = 1 + max(len(lens) * -(-per_seq // self.block_size), graph_batch)
        self._allocate_kv(num_blocks)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            hidden = self._dummy_forward(lens)
            num_rows = min(sched.max_num_seqs, tokens)
            logits = self.model.compute_logits(hidden[torch.arange(num_rows, device=self.device) % len(hidden)])
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1)
            self.sampler.sample(logits, [SamplingRow(params, [0], [0], None)] * num_rows)
            del hidden, logits
            torch.cuda.synchronize()
            activations = torch.cuda.max_memory_allocated() - base
            graph_pool = 0
            if graph_batch:  # the graphs' pool: about one eager decode step at the largest size
                torch.cuda.reset_peak_memory_stats()
                self.model.compute_logits(self._dummy_forward([1] * graph_batch)).argmax(dim=-1)
                torch.cuda.synchronize()
                graph_pool = torch.cuda.max_memory_allocated() - base
        self.kv_caches = []
        torch.cuda.empty_cache()
        now = GpuMemory.now()
        weights = torch.cuda.memory_allocated()  # resident weights (+ the offload staging buffers), nothing offloaded
        # Device memory this process took outside torch's allocator since it started (may include another
        # process's growth if one starts beside it at the same moment: the launcher starts those one by one).
        non_torch = max(0, (self.memory_at_start.free - now.free) - (now.reserved - self.memory_at_start.reserved))
        share = now.total * cache.gpu_memory_utilization
        budget = share - weights - non_torch - activations - graph_pool
        logger.info("memory profile: share %.2f GiB (%.2f x %.2f GiB), weights %.2f GiB, non-torch %.2f GiB, peak "
                    "activations %.2f GiB, decode graph pool %.2f GiB -> KV budget %.2f GiB (other processes use "
                    "%.2f GiB of the GPU)", share / 2**30, cache.gpu_memory_utilization, now.total / 2**30,
                    weights / 2**30, non_torch / 2**30, activations / 2**30, graph_pool / 2**30, budget / 2**30,
                    self.memory_at_start.used_by_others / 2**30)
        return int(max(budget, 0))

    def _dummy_forward(self, seq_lens: list[int]) -> torch.Tensor:
        """A forward over fresh sequences of these lengths (one prefill each), on blocks 1, 2, ..."""
        bs = self.block_size
        tables, slots, positions, next_block = [], [], [], 1
        for n in seq_lens:
            used = -(-n // bs)
            table = list(range(next_block, next_block + used))
            next_block += used
            tables.append(table)
            positions.extend(range(n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(n))
        meta = self.attn_backend.build_metadata(AttentionBatch(list(seq_lens), list(seq_lens), tables, slots),
                                                self.device)
        ids = torch.zeros(len(positions), dtype=torch.int64, device=self.device)
        return self.model(ids, torch.as_tensor(positions, device=self.device), self.kv_caches, meta)

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        """Allocate the KV cache (and CPU swap space), then capture the decode graphs, which bake in its address."""
        self._allocate_kv(num_blocks)
        arch = self.config.model.arch
        swap_shape = (num_swap_blocks, self.block_size, self.shard.num_kv_heads, arch.head_dim)
        pin = self.on_cuda
        self.swap_caches = [
            (torch.zeros(swap_shape, dtype=self.kv_dtype, pin_memory=pin),
             torch.zeros(swap_shape, dtype=self.kv_dtype, pin_memory=pin))
            for _ in range(arch.num_layers)
        ] if num_swap_blocks else []
        if self.graph_sizes:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(self.model, self.kv_caches, self.graph_sizes,
                                           self.config.device.max_seq_len_to_capture, self.block_size, self.device)

    def _allocate_kv(self, num_blocks: int) -> None:
        arch = self.config.model.arch
        shape = (num_blocks, self.block_size, self.shard.num_kv_heads, arch.head_dim)
        self.kv_caches = []  # drop the old cache before allocating the new one
        # Zeroed: padding slots are read (then masked), and 0 * garbage could be NaN.
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(arch.num_layers)
        ]

    def _swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        src_ids = torch.as_tensor([p[0] for p in pairs], dtype=torch.int64)
        dst_ids = torch.as_tensor([p[1] for p in pairs], dtype=torch.int64)
        for (dev_k, dev_v), (cpu_k, cpu_v) in zip(self.kv_caches, self.swap_caches, strict=True):
            if self.kv_dtype == torch.float8_e4m3fn:  # moved as bytes (no float8 index_put on CPU)
                dev_k, dev_v, cpu_k, cpu_v = (t.view(torch.uint8) for t in (dev_k, dev_v, cpu_k, cpu_v))
            if to_cpu:
                cpu_k[dst_ids] = dev_k[src_ids.to(self.device)].cpu()
                cpu_v[dst_ids] = dev_v[src_ids.to(self.device)].cpu()
            else:
                dev_k[dst_ids.to(self.device)] = cpu_k[src_ids].to(self.device)
                dev_v[dst_ids.to(self.device)] = cpu_v[src_ids].to(self.device)

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in so.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in so.new_requests:
            self.requests[new.request_id] = RunnerRequestState(
                new.sampling_params, new.prompt_token_ids, list(new.output_token_ids), self._generator(new),
                self._matcher(new))
        self._swap(so.blocks_to_swap_out, to_cpu=True)
        self._swap(so.blocks_to_swap_in, to_cpu=False)
        if self.graphs is not None and so.chunks and not so.blocks_to_swap_in and not so.blocks_to_swap_out:
            decoded = self._execute_decode_graph(so.chunks, self.graphs)
            if decoded is None:
                decoded = self._execute_verify_graph(so.chunks, self.graphs)
            if decoded is not None:
                return decoded
        self._drop_ahead()
        if not so.chunks:
            return ModelRunnerOutput({})

        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, block_tables = [], [], []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        prompt_lp_spans: list[tuple[str, int, int, int]] = []  # (request, first row, num rows, start pos)
        spec_spans: list[tuple[str, int, list[int]]] = []  # (request, first verify row, draft tokens)
        row = 0
        bs = self.block_size
        chunks = so.chunks
        if self.on_cuda:  # decode rows first: the Triton backend runs them as one decode-kernel group
            chunks = sorted(chunks, key=lambda c: len(c.token_ids) != 1)
        for chunk in chunks:
            n = len(chunk.token_ids)
            start = chunk.start_position
            input_ids.extend(chunk.token_ids)
            if n == 1:
                positions.append(start)
                slots.append(chunk.block_ids[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, start + n)
                table = np.asarray(chunk.block_ids, dtype=np.int64)
                positions.extend(pos.tolist())
                slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            query_lens.append(n)
            seq_lens.append(start + n)
            block_tables.append(chunk.block_ids)
            if chunk.prompt_logprobs:
                prompt_lp_spans.append((chunk.request_id, row, n, start))
            if chunk.sample and chunk.spec_token_ids:  # speculative: the last k + 1 rows verify k drafts
                spec_spans.append((chunk.request_id, row + n - 1 - len(chunk.spec_token_ids), chunk.spec_token_ids))
            elif chunk.sample:
                sample_rows.append(row + n - 1)
                sample_ids.append(chunk.request_id)
            row += n

        device = self.device
        batch = AttentionBatch(query_lens, seq_lens, block_tables, slots)
        if self.on_cuda:
            hidden = self._forward_cuda(input_ids, positions, batch)
        else:
            meta = self.attn_backend.build_metadata(batch, device)
            hidden = self.model(
                torch.as_tensor(input_ids, dtype=torch.int64, device=device),
                torch.as_tensor(positions, dtype=torch.int64, device=device),
                self.kv_caches, meta,
            )
        prompt_logprobs = self._prompt_logprobs(hidden, prompt_lp_spans)
        if spec_spans:
            return self._verify_and_sample(hidden, spec_spans, sample_rows, sample_ids, prompt_logprobs)
        if not sample_rows:
            return ModelRunnerOutput({}, {}, prompt_logprobs)
        if self.on_cuda and len(sample_rows) == len(hidden):  # every row samples (decode): no gather
            logits = self.model.compute_logits(hidden)
        elif self.on_cuda:
            logits = self.model.compute_logits(hidden[_pinned_to(np.asarray(sample_rows, dtype=np.int64), device)])
        else:
            logits = self.model.compute_logits(hidden[torch.as_tensor(sample_rows, device=device)])
        states = [self.requests[rid] for rid in sample_ids]
        tokens, logprobs = self._sample(logits, sample_ids, states)
        if self._step_done is not None:  # wait with the GIL released (tolist holds it for the whole step): KV
            self._step_done.record()  # transfer threads and the event loop keep running during a long prefill
            self._step_done.synchronize()
        token_list = tokens.tolist()  # the step's one host sync
        for state, token in zip(states, token_list, strict=True):
            state.record(token)
        return ModelRunnerOutput(dict(zip(sample_ids, token_list, strict=True)), logprobs, prompt_logprobs)

    def _matcher(self, new: NewRequestData) -> Any:
        guided = new.sampling_params.structured_outputs
        if guided is None:
            return None
        if self.structured_output is None:
            raise RuntimeError("a structured-output request reached a runner without a StructuredOutputManager")
        return self.structured_output.new_matcher(guided, new.output_token_ids)
    def _verify_and_sample(self, hidden: torch.Tensor, spec_spans: list[tuple[str, int, list[int]]],
                           sample_rows: list[int], sample_ids: list[str],
                           prompt_logprobs: dict[str, list[PositionLogprobs | None]],
                           rows_are_logits: bool = False) -> ModelRunnerOutput:
        """A step with speculative chunks (engine/spec/verify.py); other sampling rows are sampled as usual.
        `rows_are_logits`: `hidden` already holds every row's float32 logits (a decode-graph replay)."""
        compute_logits = (lambda rows: rows) if rows_are_logits else self.model.compute_logits
        sampled: dict[str, int] = {}
        logprobs: dict[str, PositionLogprobs] = {}
        if sample_rows:
            logits = compute_logits(hidden[torch.as_tensor(sample_rows, device=self.device)])
            states = [self.requests[rid] for rid in sample_ids]
            tokens, logprobs = self._sample(logits, sample_ids, states)
            for rid, state, token in zip(sample_ids, states, tokens.tolist(), strict=True):
                state.record(token)
                sampled[rid] = token
        accepted, spec_logprobs = verify_spans(compute_logits, hidden, spec_spans, self.requests,
                                               self.sampler.generator)
        sampled.update({rid: tokens[-1] for rid, tokens in accepted.items()})
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, accepted, spec_logprobs)

    def _generator(self, new: NewRequestData) -> torch.Generator | None:
        seed = new.sampling_params.seed
        if seed is None:
            return None
        generator = torch.Generator(device=self.device).manual_seed(seed)
        if new.generator_state:
            try:
                generator.set_state(torch.frombuffer(bytearray(new.generator_state), dtype=torch.uint8))
            except RuntimeError as exc:  # another device type produced it: the seeded stream restarts
                logger.warning("request %s: cannot restore the sampler state (%s)", new.request_id, exc)
        return generator

    def generator_state(self, request_id: str) -> bytes:
        """A request's seeded generator state (empty if unseeded or unknown)."""
        state = self.requests.get(request_id)
        if state is None or state.generator is None:
            return b""
        return state.generator.get_state().numpy().tobytes()

    def _sample(self, logits: torch.Tensor, sample_ids: list[str], states: list[RunnerRequestState]
                ) -> tuple[torch.Tensor, dict[str, PositionLogprobs]]:
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in states]
        grammar = None
        constrained = [(i, s.matcher) for i, s in enumerate(states) if s.matcher is not None]
        if constrained and self.structured_output is not None:  # host work, overlapping the GPU's forward
            bitmask = self.structured_output.fill_bitmask(len(states), constrained)
            grammar = GrammarMask(bitmask, [i for i, _ in constrained])
        tokens = self.sampler.sample(logits, rows, grammar)
        logprobs: dict[str, PositionLogprobs] = {}
        wants = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if wants:
            index = torch.as_tensor(wants, device=logits.device)
            entries = gather_logprobs(logits[index].log_softmax(dim=-1), tokens[index],
                                      [states[i].params.logprobs or 0 for i in wants])
            logprobs = {sample_ids[i]: entry for i, entry in zip(wants, entries, strict=True)}
        return tokens, logprobs

    # ---- decode steps from CUDA graphs -------------------------------------------------------------------
    def _execute_decode_graph(self, chunks: list[ScheduledChunk], graphs: DecodeGraphs) -> ModelRunnerOutput | None:
        """A decode-only step within the captured bounds: the matching decode-ahead replay, or one replay now;
        then, for an all-greedy batch, queue the next step's replay before waiting for this step's ids. None:
        not such a step (the caller runs it eagerly)."""
        for chunk in chunks:
            if len(chunk.token_ids) != 1 or not chunk.sample or chunk.prompt_logprobs:
                return None
        positions = [chunk.start_position for chunk in chunks]
        n = len(chunks)
        if not graphs.can_run(n, max(positions) + 1):
            return None
        bs = self.block_size
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.matches(chunks, bs):
            result = ahead.result
            self.ahead_hits += 1
            self.ahead_score = min(1.0, 0.9 * self.ahead_score + 0.1)
        else:
            if ahead is not None:
                self._count_miss()
            slots = [chunk.block_ids[p // bs] * bs + p % bs for chunk, p in zip(chunks, positions, strict=True)]
            result = graphs.run([chunk.token_ids[0] for chunk in chunks], positions, slots,
                                [p + 1 for p in positions], [chunk.block_ids for chunk in chunks])
        ids = [chunk.request_id for chunk in chunks]
        states = [self.requests[rid] for rid in ids]
        greedy = all(_greedy_argmax(state) for state in states)
        logprobs: dict[str, PositionLogprobs] = {}
        if greedy and all(state.matcher is None for state in states):
            tokens = result.tokens  # the sampler would take the same argmax of the same logits
        else:  # grammar masks (filled on the host while the GPU runs), or sampling
            tokens, logprobs = self._sample(result.logits, ids, states)
        graphs.tokens_to_host(tokens)
        if greedy:  # the next step's inputs are known on the device: queue its replay now. A constrained row's
            # next mask needs this step's token on the host, which the next step's sampling has by then.
            self._queue_ahead(chunks, positions, states, tokens, graphs)
        token_list = graphs.host_tokens(n)  # waits for this step only, not for the replay queued ahead
        if self.ahead is not None:
            self.ahead.tokens = token_list
        for state, token in zip(states, token_list, strict=True):
            state.record(token)
        return ModelRunnerOutput(dict(zip(ids, token_list, strict=True)), logprobs, {})

    def _execute_verify_graph(self, chunks: list[ScheduledChunk], graphs: DecodeGraphs) -> ModelRunnerOutput | None:
        """A speculative step whose chunks all sample, replayed from a decode graph with one row per token
        (`expand_to_decode_rows`): the eager extend forward it replaces cost 2.3x a decode replay on an H100 at
        batch 1. None: not such a step, or more rows / context than the graphs cover (the caller runs it eagerly)."""
        if not any(chunk.spec_token_ids for chunk in chunks):
            return None
        for chunk in chunks:
            if not chunk.sample or chunk.prompt_logprobs:
                return None
        num_rows = sum(len(chunk.token_ids) for chunk in chunks)
        max_len = max(chunk.start_position + len(chunk.token_ids) for chunk in chunks)
        if not graphs.can_run(num_rows, max_len):
            return None
        self._drop_ahead()  # its KV slots are rewritten by this step's rows
        rows = expand_to_decode_rows(chunks, self.block_size)
        result = graphs.run(rows.input_ids, rows.positions, rows.slots, rows.seq_lens, rows.block_tables)
        states = [self.requests[chunk.request_id] for chunk in chunks]
        if all(_plain_greedy(state) for state in states):  # the graph's argmax is the verdict: no logits work
            graphs.tokens_to_host(result.tokens)
            ids = graphs.host_tokens(len(rows.positions))
            sampled = {rid: ids[row] for rid, row in zip(rows.sample_ids, rows.sample_rows, strict=True)}
            accepted = {rid: verify_greedy(ids[first : first + len(drafts) + 1], drafts)
                        for rid, first, drafts in rows.spec_spans}
            for rid, token in sampled.items():
                self.requests[rid].record(token)
            for rid, tokens in accepted.items():
                self.requests[rid].output_token_ids.extend(tokens)
                sampled[rid] = tokens[-1]
            return ModelRunnerOutput(sampled, {}, {}, accepted, {})
        return self._verify_and_sample(result.logits, rows.spec_spans, rows.sample_rows, rows.sample_ids, {},
                                       rows_are_logits=True)

    def _queue_ahead(self, chunks: list[ScheduledChunk], positions: list[int], states: list[RunnerRequestState],
                     tokens: torch.Tensor, graphs: DecodeGraphs) -> None:
        """Replay the step after this one now, if every row will still be running and its next KV slot is in a
        block it already holds (else the scheduler allocates first: nothing to guess)."""
        if self.ahead_score < AHEAD_MIN_SCORE:
            self.ahead_score += AHEAD_RECOVERY
            return
        bs = self.block_size
        max_len = self.config.model.max_model_len
        nxt = [p + 1 for p in positions]
        for chunk, state, p in zip(chunks, states, nxt, strict=True):
            max_tokens = state.params.max_tokens
            if (p // bs >= len(chunk.block_ids) or p + 1 >= max_len
                    or (max_tokens is not None and len(state.output_token_ids) + 1 >= max_tokens)):
                return
        if not graphs.can_run(len(nxt), max(nxt) + 1):
            return
        slot_blocks = [chunk.block_ids[p // bs] for chunk, p in zip(chunks, nxt, strict=True)]
        slots = [blk * bs + p % bs for blk, p in zip(slot_blocks, nxt, strict=True)]
        ahead_result = graphs.run_ahead(tokens, nxt, slots, [p + 1 for p in nxt],
                                        [chunk.block_ids for chunk in chunks])
        self.ahead = AheadStep([chunk.request_id for chunk in chunks], nxt, slot_blocks, ahead_result)

    def _drop_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead = None
            self._count_miss()

    def _count_miss(self) -> None:
        self.ahead_misses += 1
        self.ahead_score *= 0.5

    def _forward_cuda(self, input_ids: list[int], positions: list[int], batch: AttentionBatch) -> torch.Tensor:
        """Eager forward (decode steps the graphs cover never get here)."""
        ids_positions = _pinned_to(np.array([input_ids, positions], dtype=np.int64), self.device)
        meta = self.attn_backend.build_metadata(batch, self.device)
        return self.model(ids_positions[0], ids_positions[1], self.kv_caches, meta)

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         spans: list[tuple[str, int, int, int]]) -> dict[str, list[PositionLogprobs | None]]:
        """Logprob of each prompt token given its prefix: row r predicts the token at position start + r + 1."""
        out: dict[str, list[PositionLogprobs | None]] = {}
        for request_id, first_row, num_rows, start in spans:
            state = self.requests[request_id]
            prompt = state.prompt_token_ids
            entries: list[PositionLogprobs | None] = [None] if start == 0 else []
            targets = prompt[start + 1 : start + num_rows + 1]
            if targets:
                rows = hidden[first_row : first_row + len(targets)]
                lp = self.model.compute_logits(rows).log_softmax(dim=-1)
                tokens = torch.as_tensor(targets, device=hidden.device)
                entries.extend(gather_logprobs(lp, tokens, [state.params.prompt_logprobs or 0] * len(targets)))
            out[request_id] = entries
        return out
