"""Model runner: owns the device, the weights and the KV cache; turns a `SchedulerOutput` into sampled tokens.

It keeps per-request sampling state (sent once as `NewRequestData`, engine/runner/input_batch.py) and gets only
token ids, positions and block tables each step.

On CUDA the model is built in place on the GPU in its dtype, uses the Triton kernels (attention backend and fused
layer ops), replays decode-only steps from CUDA graphs (forward, lm_head and greedy argmax in one replay;
engine/runner/graph_execution.py, with decode-ahead in engine/runner/decode_ahead.py), and sizes the KV cache
(engine/runner/kv_cache.py) from a memory profile (engine/runner/memory.py). The CPU path keeps plain torch ops
(the numerics tested token-exact against transformers).

Invariants:
- A step first drops finished requests' state and adds the new ones', then swaps blocks out, runs the host KV
  tier's copies (engine/runner/kv_tier.py), swaps blocks in, then computes.
- A step that a decode graph covers gives the same tokens as the eager path would; any other step first drops a
  replay queued ahead.
- One host sync per step (the sampled ids); on CUDA the wait before it releases the GIL.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv_layout import DTYPES
from engine.models.llama import CausalLM
from engine.models.loader import hf_state_dict
from engine.models.moe import MoECausalLM
from engine.models.registry import model_class
from engine.outputs import (
    ModelRunnerOutput,
    PositionLogprobs,
    ScheduledChunk,
    SchedulerOutput,
    TierCopy,
)
from engine.parallel.group import TPGroup
from engine.parallel.layout import RankShard, shard_for
from engine.parallel.pipeline import StageLink
from engine.parallel.sharding import held_checkpoint_keys, init_dummy_sharded, load_sharded_state
from engine.parallel.stages import PipelineStage
from engine.process.cpu_memory import keep_freed_memory_for_reuse, release_freed_memory
from engine.runner.attention import AttentionBackend, KVCache, TorchPagedAttention
from engine.runner.compile_watch import CompileWatch
from engine.runner.cpu_linear import pack_linears_for_cpu
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from engine.runner.decode_ahead import DecodeAhead
from engine.runner.graph_execution import decode_graph_step, verify_graph_step
from engine.runner.input_batch import DecodeRows, RunnerRequestState, StepRows, step_rows
from engine.runner.kv_cache import (
    DEFAULT_CPU_KV_BYTES,
    KVCacheSpec,
    kv_cache_dtype,
    set_kv_scales,
    swap_blocks,
)
from engine.runner.kv_tier import KVTierCopier, stage_blocks_for
from engine.runner.memory import GpuMemory, MemoryProfiler, ProfileShape
from engine.runner.sampler import GrammarMask, Sampler, SamplingRow, gather_logprobs
from engine.runner.warmup import warm_up
from engine.runner.weight_offload import LayerWeightStream, OffloadPlan, parameter_bytes, plan_offload
from engine.spec.verify import verify_spans
from engine.structured.grammar import StructuredOutputManager
from kernels._triton import HAS_TRITON

logger = logging.getLogger(__name__)


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


def load_model(config: EngineConfig, device: torch.device, attn_backend: AttentionBackend, shard: RankShard,
               tp_group: TPGroup | None, fused: bool, stage: PipelineStage | None = None) -> CausalLM:
    """This rank's model (its pipeline `stage`'s part), built in place (on CUDA: on the GPU, in the model dtype),
    its weights loaded or initialized, the leading layers `cpu_offload_gb` names streamed from pinned host memory,
    and the fp8 KV scales set."""
    dtype = DTYPES[config.model.dtype]
    on_cuda = device.type == "cuda"
    arch = config.model.arch
    started = time.perf_counter()
    torch.manual_seed(config.model.seed)
    # On CUDA every tensor is created on the GPU in the model dtype (an 8B model never touches the CPU).
    build_dtype = dtype if on_cuda else torch.get_default_dtype()
    offload = _offload_plan(config, dtype, attn_backend, shard, fused, single_gpu=on_cuda and tp_group is None)
    # `stage` only when the model is split: a model class without pipeline support still builds unsplit
    split = {"stage": stage} if stage is not None and stage.size > 1 else {}
    with torch.device(device), default_dtype(build_dtype):
        model = model_class(arch.architecture)(
            arch, config.model.hf_config, attn_backend, config.model.max_model_len, fused_ops=fused, shard=shard,
            group=tp_group, host_layers=offload.num_layers, **split)
    if offload.num_layers:  # before loading: the offloaded layers' weights go straight to pinned host memory
        model.weight_stream = LayerWeightStream(model.layers[: offload.num_layers], device)
    if config.model.quantization is not None:
        from engine.quant.loading import load_quantized

        load_quantized(model, config.model)
    elif config.model.load_format == "dummy" and tp_group is not None:
        init_dummy_sharded(model, config.model.seed, arch, shard)
    elif config.model.load_format == "dummy":
        model.init_dummy_weights(config.model.seed, device)
    elif tp_group is not None or (stage is not None and stage.size > 1):  # read only this rank's tensors
        assert config.model.model_path is not None
        model.load_hf_state_dict(load_sharded_state(config.model.model_path, arch, shard,
                                                    held_checkpoint_keys(model)))
    else:
        assert config.model.model_path is not None
        model.load_hf_state_dict(hf_state_dict(config.model.model_path))
    if kv_cache_dtype(config.cache.kv_cache_dtype, dtype) == torch.float8_e4m3fn:
        set_kv_scales(model, config.model.model_path if config.model.load_format != "dummy" else None)
    if model.weight_stream is not None:
        model.weight_stream.activate()
        offload.log()
    if fused:
        model.prepare_fused_weights()
    if on_cuda:
        model = model.eval()  # already in dtype; the rotary tables stay fp32 as built
        torch.cuda.synchronize(device)  # the load time logged below includes the device work
    else:
        model = model.to(dtype).eval()
        if dtype == torch.float32:
            pack_linears_for_cpu(model, batch_hint=min(config.scheduler.max_num_seqs, 128))
        release_freed_memory()  # the loaded state dict (engine/process/cpu_memory.py)
        keep_freed_memory_for_reuse()
        model.rotary.to(torch.float32)  # cos/sin cache stays fp32, cast per use
    logger.info("loaded %s (%.1fM params, %s) in %.1fs", config.model.model, arch.num_params / 1e6,
                config.model.dtype, time.perf_counter() - started)
    return model


def _offload_plan(config: EngineConfig, dtype: torch.dtype, attn_backend: AttentionBackend, shard: RankShard,
                  fused: bool, single_gpu: bool) -> OffloadPlan:
    """The leading layers `cpu_offload_bytes` puts in host memory (engine/runner/weight_offload.py); sized from a
    layer built on the meta device, so it is exact for this model, dtype and shard."""
    budget = config.cache.cpu_offload_bytes
    num_layers = config.model.arch.num_layers
    if not budget:
        return OffloadPlan(0, 0, num_layers)
    if not single_gpu:  # EngineArgs refuses the other cases first, naming the flag
        raise ValueError("cpu_offload_gb needs a single-GPU runner on CUDA")
    with torch.device("meta"), default_dtype(dtype):
        probe = model_class(config.model.arch.architecture).layer_class(config.model.arch, attn_backend, fused, shard)
    return plan_offload(budget, parameter_bytes(probe), num_layers)


def _pinned_to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync: the host keeps queueing work while the copy runs."""
    return torch.from_numpy(array).pin_memory().to(device, non_blocking=True)


class ModelRunner:
    """One rank's runner; with `tp_group` (tensor parallelism, engine/parallel/) it holds and computes only this
    rank's shard, and every rank runs the same steps (engine/parallel/executor.py). With `link` (pipeline
    parallelism, engine/parallel/pipeline.py) it holds its stage's layers and their KV only; a stage before the
    last passes its activations on and samples nothing."""

    def __init__(self, config: EngineConfig, tp_group: TPGroup | None = None, link: StageLink | None = None,
                 leader: bool = True) -> None:
        self.config = config
        self.tp_group = tp_group
        self.link = link
        self.stage = link.stage if link is not None else PipelineStage.whole(config.model.arch.num_layers)
        self.shard = shard_for(config.model.arch, tp_group.rank, tp_group.size,
                               config.device.enable_expert_parallel) if tp_group is not None \
            else RankShard.full(config.model.arch)
        self.device = torch.device(config.device.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device, by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = DTYPES[config.model.dtype]
        self.kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.kv_dtype_name = str(self.kv_dtype).removeprefix("torch.")
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.kv_spec = KVCacheSpec(self.stage.num_layers, self.block_size, self.shard.num_kv_heads, arch.head_dim,
                                   self.kv_dtype)
        self.on_cuda = self.device.type == "cuda"
        self.memory_at_start: GpuMemory | None = None
        self.compile_watch: CompileWatch | None = None  # after the warm-up: Triton compiles while serving
        if self.on_cuda:
            torch.cuda.set_device(self.device)  # this thread; the engine thread binds itself too (bind_thread)
            self.memory_at_start = GpuMemory.now()
            if config.cache.kv_cache_memory_bytes is None and config.cache.num_gpu_blocks_override is None:
                self.memory_at_start.check_share(config.cache.gpu_memory_utilization, self.device)
        self.attn_backend = select_attention_backend(self.device, self.block_size)
        fused = self.on_cuda and HAS_TRITON
        self.model = load_model(config, self.device, self.attn_backend, self.shard, tp_group, fused, self.stage)
        self.sampler = Sampler(config.model.seed, self.device)
        self.structured_output: StructuredOutputManager | None = None  # the engine sets it (it owns the tokenizer)
        self.requests: dict[str, RunnerRequestState] = {}
        self.kv_caches: list[KVCache] = []
        self.swap_caches: list[KVCache] = []
        self.kv_tier: KVTierCopier | None = None  # the host KV tier (--kv-offloading-size)
        self.graph_sizes = capture_sizes(config.scheduler.max_num_seqs, config.device.cudagraph_capture_sizes,
                                         config.device.enforce_eager) if fused and self.stage.size == 1 else []
        # (pipeline stages run eager: a graph would have to capture the receive and send as well)
        self.graphs: DecodeGraphs | None = None
        self._step_done = torch.cuda.Event() if self.on_cuda else None
        self.leader = leader  # rank 0 (the engine's process): its samples are the engine's; it holds the grammars
        tensor_parallel = tp_group is not None and tp_group.size > 1
        self.decode_ahead = DecodeAhead(self.block_size, config.model.max_model_len, tensor_parallel)

    @property
    def kv_scales(self) -> tuple[float, ...]:
        """fp8 cache: each layer's k_scale, v_scale in order (part of the KV layout P/D peers must share)."""
        if self.kv_dtype != torch.float8_e4m3fn:
            return ()
        layers = self.model.layers[self.stage.start : self.stage.end]
        return tuple(s for layer in layers for s in layer.self_attn.kv_scales)

    @property
    def all_reduce_kind(self) -> str:
        """Which all-reduce the tensor-parallel layers run (the worker's Info): 'none' with a single rank."""
        return self.tp_group.all_reduce_kind if self.tp_group is not None and self.tp_group.size > 1 else "none"

    def check_ranks(self) -> None:
        """Raise if a tensor-parallel rank is gone (a single rank has none to lose)."""

    def shutdown(self) -> None:
        """Stop what the runner started (tensor-parallel ranks); nothing for a single rank."""

    def release_graphs(self) -> None:
        """Drop the decode graphs (and a replay queued ahead) once the GPU is done with them. An NCCL
        communicator whose collectives a live graph still holds hangs in ncclCommAbort, so tensor-parallel ranks
        call this before closing their group."""
        self.decode_ahead.clear()
        if self.graphs is not None:
            self.graphs = None
            if self.on_cuda:
                torch.cuda.synchronize(self.device)

    # ---- KV cache ----------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its KV heads only)."""
        return self.kv_spec.block_bytes

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget (or the override); a value, never written back into config."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            budget = self._profile_kv_budget()
            if cache.kv_offloading_bytes and cache.kv_cache_memory_bytes is None:  # the tier's staging buffer
                budget -= self.block_bytes * stage_blocks_for(self.block_bytes,
                                                              cache.kv_offloading_bytes // self.block_bytes)
        else:
            budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        num_blocks = self.kv_spec.num_blocks_in(budget)
        if self.on_cuda:
            max_len = self.config.model.max_model_len
            logger.info("GPU KV cache: %d blocks (%.2f GiB, %d tokens); max concurrency %.2fx at %d tokens per "
                        "request", num_blocks, num_blocks * self.block_bytes / 2**30, num_blocks * self.block_size,
                        (num_blocks - 1) * self.block_size / max_len, max_len)
        return num_blocks

    def _profile_kv_budget(self) -> int:
        """Bytes left for KV in this worker's share of the GPU (engine/runner/memory.py)."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        assert self.memory_at_start is not None  # set in __init__ on CUDA
        shape = ProfileShape.largest(sched.max_num_batched_tokens, sched.max_num_seqs,
                                     self.config.model.max_model_len, max(self.graph_sizes, default=0))
        profiler = MemoryProfiler(self.model, self.attn_backend, self.sampler, self.device, self.stage.is_last)
        return profiler.kv_budget(self.kv_spec, shape, self.memory_at_start, cache.gpu_memory_utilization)

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        """Allocate the KV cache (and CPU swap space), capture the decode graphs, which bake in its address, then
        (CUDA) warm every eager kernel variant (engine/runner/warmup.py), so none compiles while serving. The CPU
        path compiles nothing at run time: its C++ kernels are built when the model loads."""
        self._allocate_kv(num_blocks)
        self.swap_caches = self.kv_spec.allocate_swap(num_swap_blocks, pin=self.on_cuda)
        if self.graph_sizes:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(self.model, self.kv_caches, self.graph_sizes,
                                           self.config.device.max_seq_len_to_capture, self.block_size, self.device)
        if self.on_cuda:
            warm_up(self)
            if self.compile_watch is None:
                self.compile_watch = CompileWatch()
                self.compile_watch.install()
        self.take_expert_load()  # the profile, capture and warm-up forwards routed no real token

    def take_expert_load(self) -> np.ndarray | None:
        """MoE models: tokens routed to each expert [sparse layer, expert] since the last call; None if dense."""
        return self.model.take_expert_load() if isinstance(self.model, MoECausalLM) else None

    def allocate_host_tier(self, num_blocks: int) -> None:
        """The host KV tier's pool (pinned beside a GPU cache; a second CPU pool beside a CPU one)."""
        spec = self.kv_spec
        self.kv_tier = KVTierCopier(spec.allocate_host_pool(num_blocks, pin=self.on_cuda),
                                    (spec.block_size, spec.num_kv_heads, spec.head_dim), self.device)

    @torch.inference_mode()
    def run_kv_tier_copies(self, copies: list[TierCopy]) -> torch.cuda.Event | None:
        """Host-tier copies queued between steps (a remote admission's), queued now. On CUDA the event a KV
        transport's stream must wait for before it writes the reserved blocks (`KVPort.after`): the engine
        thread does not wait. A decode replay queued ahead is left alone."""
        if self.kv_tier is None or not copies:
            return None
        return self.kv_tier.run(copies, self.kv_caches)

    def _allocate_kv(self, num_blocks: int) -> None:
        self.kv_caches = []  # drop the old cache before allocating the new one
        self.kv_caches = self.kv_spec.allocate(num_blocks, self.device)

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_requests(so)
        swap_blocks(self.kv_caches, self.swap_caches, so.blocks_to_swap_out, to_host=True)
        if self.kv_tier is not None:
            self.kv_tier.run(so.kv_tier_copies, self.kv_caches)
        swap_blocks(self.kv_caches, self.swap_caches, so.blocks_to_swap_in, to_host=False)
        if self.graphs is not None and so.chunks and not so.blocks_to_swap_in and not so.blocks_to_swap_out:
            replayed = self._execute_graphs(so.chunks, self.graphs)
            if replayed is not None:
                return replayed
        self.decode_ahead.drop()
        if not so.chunks:
            return ModelRunnerOutput({})
        rows = step_rows(so.chunks, self.block_size, decode_first=self.on_cuda)
        hidden = self._forward(rows)
        if not self.stage.is_last:  # the activations went on to the next stage
            return ModelRunnerOutput({})
        prompt_logprobs = self._prompt_logprobs(hidden, rows.prompt_logprob_spans)
        if rows.spec_spans:
            return self._verify_and_sample(hidden, rows.spec_spans, rows.sample_rows, rows.sample_ids,
                                           prompt_logprobs)
        if not rows.sample_rows:
            return ModelRunnerOutput({}, {}, prompt_logprobs)
        return self._sample_step(hidden, rows, prompt_logprobs)

    def _update_requests(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in so.new_requests:
            self.requests[new.request_id] = RunnerRequestState.from_new(new, self.device, self.structured_output,
                                                                        self.leader)

    def _execute_graphs(self, chunks: list[ScheduledChunk], graphs: DecodeGraphs) -> ModelRunnerOutput | None:
        """The step replayed from the decode graphs (engine/runner/graph_execution.py); None: run it eagerly."""
        decoded = decode_graph_step(chunks, self.block_size, graphs, self.decode_ahead, self.requests, self._sample)
        if decoded is not None:
            return decoded
        return verify_graph_step(chunks, self.block_size, graphs, self.decode_ahead, self.requests,
                                 self._verify_replayed_rows)

    def _forward(self, rows: StepRows) -> torch.Tensor:
        """The eager forward (decode steps the graphs cover never get here)."""
        device = self.device
        if self.on_cuda:  # ids and positions in one pinned copy
            ids_positions = _pinned_to(np.array([rows.input_ids, rows.positions], dtype=np.int64), device)
            input_ids, positions = ids_positions[0], ids_positions[1]
        else:
            input_ids = torch.as_tensor(rows.input_ids, dtype=torch.int64, device=device)
            positions = torch.as_tensor(rows.positions, dtype=torch.int64, device=device)
        meta = self.attn_backend.build_metadata(rows.attention, device)
        if self.link is not None:
            return self.link.forward(lambda inter: self.model(input_ids, positions, self.kv_caches, meta, inter),
                                     len(rows.input_ids), device)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _sample_step(self, hidden: torch.Tensor, rows: StepRows,
                     prompt_logprobs: dict[str, list[PositionLogprobs | None]]) -> ModelRunnerOutput:
        """Sample the step's sampling rows and wait for their ids."""
        sample_rows, sample_ids, device = rows.sample_rows, rows.sample_ids, self.device
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

    def _verify_replayed_rows(self, logits: torch.Tensor, rows: DecodeRows) -> ModelRunnerOutput:
        """A verify step replayed from a decode graph whose requests do not all take the raw argmax."""
        return self._verify_and_sample(logits, rows.spec_spans, rows.sample_rows, rows.sample_ids, {},
                                       rows_are_logits=True)

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
