"""The engine loop: validate and enqueue requests, then `step()` = schedule -> run model -> update -> outputs.

The parts it wires together: input processing (engine/processing/input_processor.py), the scheduler and KV cache
manager (engine/core/), the runner (engine/runner/, through engine/parallel/executor.py), output processing
(engine/processing/output_processor.py) and the decode side of P/D (engine/remote_prefill.py).

Invariants:
- One thread drives the engine at a time (the async engine's, or the caller's under `LLM`); nothing here locks.
- A request id is unique among the requests in flight; a refused request leaves nothing behind.
- Each step, the runner samples a request's tokens, the scheduler takes them (stop rules, KV), then the output
  processor (text, stop strings, outputs).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.arg_utils import EngineArgs
from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from engine.core.host_tier import HostKVTier
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_budget import StepTimeModel
from engine.core.swap_space import SwapSpace
from engine.errors import InvalidRequest
from engine.kv_port import KVPort
from engine.metrics.busy import BusyMeter
from engine.metrics.reload_cost import ReloadCost
from engine.metrics.stats import EngineStats, FinishedRequestTiming
from engine.outputs import PositionLogprobs, RequestOutput, SchedulerOutput
from engine.parallel.batch_queue import BatchQueue
from engine.parallel.executor import DEFAULT_RANK_MODULE, TPDriverRunner, create_runner, kv_ranks
from engine.processing.generation_config import resolve_generation_defaults
from engine.processing.input_processor import InputProcessor, PromptInput, eos_token_id
from engine.processing.output_processor import OutputKind, OutputProcessor, RequestState
from engine.processing.tokenizer import load_tokenizer
from engine.remote_prefill import RemotePrefill, RemoteSlot, check_remote_params
from engine.sampling_params import SamplingParams
from engine.spec.proposer import DraftModelProposer, build_proposer
from engine.structured.grammar import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int  # queued plus waiting for remote KV
    queued_prefill_tokens: int  # prompt tokens admitted or waiting but not yet computed
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    num_preemptions: int
    busy_fraction: float = 0.0  # share of the last seconds spent in steps (engine/metrics/busy.py)
    prefill_tokens_per_s: float = 0.0  # how fast a prompt admitted now would prefill; 0: not known yet
    host_reload_cost: float = 0.0  # a host-tier block's load over its recompute time (engine/metrics/reload_cost.py)
    external_prefix_cache_hits: int = 0  # prompt tokens loaded back from the host tier (cumulative)
    host_dropped_blocks: int = 0  # blocks a full host tier let go (cumulative)


class LLMEngine:
    def __init__(self, config: EngineConfig, enable_kv_events: bool = False,
                 rank_module: str = DEFAULT_RANK_MODULE, rank_env: Mapping[str, str] | None = None) -> None:
        self.config = config
        # tensor parallelism: rank 0's runner, the other ranks started (`python -m rank_module`)
        self.runner = create_runner(config, rank_module, rank_env)
        # pipeline parallelism: one micro-batch in flight per stage (engine/parallel/batch_queue.py)
        pp = config.device.pipeline_parallel_size
        self.batches = BatchQueue(pp) if pp > 1 and isinstance(self.runner, TPDriverRunner) else None
        # Speculative decoding (engine/spec/proposer.py); a draft model is loaded before the memory profile.
        self.proposer = build_proposer(config)
        num_blocks, num_swap = self._initialize_kv_cache()
        self.num_gpu_blocks = num_blocks
        # what KV transports may touch
        self.kv_port = KVPort(self.runner.kv_caches, self.runner.kv_dtype_name, self.runner.kv_scales,
                              kv_ranks(self.runner))
        self.hasher = BlockHasher.for_model(config.model.model_id, config.cache.block_size)
        self.kv_manager = KVCacheManager(num_blocks, config.cache.block_size, self.hasher,
                                         config.cache.enable_prefix_caching, enable_kv_events,
                                         self._host_tier())
        self.busy = BusyMeter()
        self.reload_cost = ReloadCost(config.cache.block_size)
        # --itl-target-ms: the engine times each step and feeds this model; the scheduler asks it for budgets.
        self.step_model = (StepTimeModel(floor_tokens=max(16, config.cache.block_size))
                           if config.scheduler.itl_target_ms is not None else None)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, SwapSpace(num_swap) if num_swap else None,
                                   self.step_model)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path)
        self.eos_token_id = eos_token_id(self.tokenizer, config.model.hf_config)
        self.structured_output = StructuredOutputManager(self.tokenizer, config.model.arch.vocab_size,
                                                         self.eos_token_id, config=config.structured_outputs,
                                                         limits=config.structured_output_limits)
        self.runner.structured_output = self.structured_output
        self.generation_defaults: dict[str, Any] = resolve_generation_defaults(
            config.model.generation_config, config.model.model_path, config.model.override_generation_config)
        if self.generation_defaults:
            logger.info("Default sampling parameters have been overridden by the generation config: %s (use "
                        "generation_config='vllm' to ignore the model's)", self.generation_defaults)
        self.stats = EngineStats(num_gpu_blocks=num_blocks)
        self.inputs = InputProcessor(config, self.tokenizer, self.eos_token_id, self.generation_defaults,
                                     self.structured_output, self.device)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.stats)
        self.remote_prefill = RemotePrefill(self.scheduler, self.kv_manager, self.outputs, config.cache.block_size)
        self._ids = itertools.count()
        self.num_lease_expired_blocks = 0  # P/D prefill side: held blocks freed because no transfer finished

    @classmethod
    def from_engine_args(cls, args: EngineArgs, enable_kv_events: bool = False,
                         rank_module: str = DEFAULT_RANK_MODULE, rank_env: Mapping[str, str] | None = None
                         ) -> LLMEngine:
        return cls(args.create_engine_config(), enable_kv_events, rank_module, rank_env)

    def _initialize_kv_cache(self) -> tuple[int, int]:
        """Size the KV cache (shared with a draft model) and the swap space, and allocate them on the runner."""
        config = self.config
        num_blocks = self.runner.determine_num_blocks()
        if isinstance(self.proposer, DraftModelProposer):
            # Same block count for target and draft (the same block tables' lengths): split the KV budget.
            if config.cache.num_gpu_blocks_override is None:
                own = self.runner.block_bytes
                num_blocks = max(2, num_blocks * own // (own + self.proposer.block_bytes))
            self.proposer.initialize(num_blocks)
        capacity = (num_blocks - 1) * config.cache.block_size
        if config.model.max_model_len > capacity:
            raise ValueError(
                f"The model's max seq len ({config.model.max_model_len}) is larger than the maximum number of tokens "
                f"that can be stored in KV cache ({capacity}). Try increasing kv_cache_memory_bytes / "
                "gpu_memory_utilization or decreasing max_model_len."
            )
        num_swap = 0
        if config.scheduler.preemption_mode == "swap":
            num_swap = config.cache.swap_space_bytes // self.runner.block_bytes
        self.runner.initialize_kv_cache(num_blocks, num_swap)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), max concurrency %.1fx at %d tokens/request",
                    num_blocks, config.cache.block_size, capacity, capacity / config.model.max_model_len,
                    config.model.max_model_len)
        return num_blocks, num_swap

    def _host_tier(self) -> HostKVTier | None:
        """The host KV tier (--kv-offloading-size): its slots' bookkeeping here, its memory on the runner."""
        size = self.config.cache.kv_offloading_bytes
        if not size:
            return None
        num_host = size // self.runner.block_bytes
        if num_host < 1:
            raise ValueError(f"kv_offloading_size ({size} bytes) holds no KV block of {self.runner.block_bytes} bytes")
        self.runner.allocate_host_tier(num_host)
        logger.info("KV offloading (native): %d host blocks (%.2f GiB, %d tokens)", num_host,
                    num_host * self.runner.block_bytes / 2**30, num_host * self.config.cache.block_size)
        return HostKVTier(num_host)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptInput, params: SamplingParams | None = None,
                    output_kind: OutputKind = "cumulative", extra_keys: tuple[str, ...] = (),
                    kv_lease_s: float | None = None, resume_output_token_ids: list[int] | None = None) -> str:
        """Validate and enqueue; raises InvalidRequest (nothing is enqueued) for bad input.

        `kv_lease_s` (prefill side of P/D): keep the finished request's blocks until `release_kv` or the lease.
        `resume_output_token_ids` (migration): the tokens another engine already generated for this request; they
        count as output (max_tokens, penalties, stop rules) and are not returned again, and a seeded request's
        generator continues after them. Single-sample requests only.
        """
        state = self._new_state(request_id, prompt, params, output_kind, extra_keys, kv_lease_s,
                                list(resume_output_token_ids or []))
        for sample in state.samples:
            self.scheduler.add_request(sample.request)
        return state.request_id

    def _new_state(self, request_id: str | None, prompt: PromptInput, params: SamplingParams | None,
                   output_kind: OutputKind, extra_keys: tuple[str, ...], kv_lease_s: float | None,
                   resumed: list[int]) -> RequestState:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.states:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        processed = self.inputs.process(request_id, prompt, params, extra_keys, kv_lease_s, resumed)
        return self.outputs.add(processed, output_kind)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            state = self.outputs.states.get(request_id)
            if state is None:
                continue
            self.scheduler.finish_requests([s.request.request_id for s in state.samples],
                                           RequestStatus.FINISHED_ABORTED)
            self.outputs.pending.append(self.outputs.finish(state))

    def abort_all(self) -> None:
        self.abort_request(list(self.outputs.states))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.outputs.pending) or \
            (self.batches is not None and self.batches.busy)

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.states)

    # ---- the decode side of P/D (engine/remote_prefill.py) -------------------------------------------------
    def add_remote_prefill_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                                   output_kind: OutputKind = "cumulative", extra_keys: tuple[str, ...] = (),
                                   min_uncached_tokens: int = 0) -> RemoteSlot | None:
        """Admit a request whose prompt KV a prefill worker computes: blocks for the whole prompt are reserved
        now, and it is not scheduled until `finish_remote_prefill` (or `fail_remote_prefill`, which recomputes
        locally). None, with nothing enqueued, when the prompt has fewer than `min_uncached_tokens` uncached
        tokens or the pool has no room: prefill locally then. Raises InvalidRequest for bad input, and for n > 1
        or prompt_logprobs (those always prefill locally)."""
        check_remote_params(params)
        state = self._new_state(request_id, prompt, params, output_kind, extra_keys, None, [])
        slot = self.remote_prefill.admit(state, min_uncached_tokens)
        self._run_tier_copies()  # before a transport writes into blocks whose old content is still being saved
        return slot

    def _run_tier_copies(self) -> None:
        """Queue host-tier copies queued outside a step (a remote admission's evictions and loads) now; a KV
        transport's writes wait for them on the device (`KVPort.after`), not this thread."""
        done = self.runner.run_kv_tier_copies(self.kv_manager.take_tier_copies())  # one runner: TP has no tier
        if done is not None:
            self.kv_port.after(done)

    def finish_remote_prefill(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                              sampler_state: bytes = b"") -> None:
        """The prompt's KV was written into the reserved blocks (the writes have completed): decode on from the
        remotely sampled token. `sampler_state` is the prefill side's seeded generator after that token
        (`sampler_state()`), so seeded sampling continues exactly as a unified engine would."""
        self.remote_prefill.finish(request_id, first_token, logprobs, sampler_state)

    def take_remote_first_token(self, request_id: str, first_token: int, logprobs: PositionLogprobs | None,
                                sampler_state: bytes = b"") -> bool:
        """The prefill worker sampled the first token; its KV is still on the way. Deliver the token now and keep
        waiting for the KV before decoding on; False when declined (`RemotePrefill.take_first_token`)."""
        return self.remote_prefill.take_first_token(request_id, first_token, logprobs, sampler_state)

    def fail_remote_prefill(self, request_id: str) -> None:
        """The prefill worker failed: recompute the prompt here (its reserved blocks are dropped), with the first
        token if `take_remote_first_token` took it."""
        self.remote_prefill.fail(request_id)

    # ---- what the worker runtime and KV transports may ask (no reaching into scheduler or runner) -----------
    def sampler_state(self, request_id: str) -> bytes:
        """Prefill side: the request's seeded generator state (empty if unseeded); read it right after the step
        that sampled, before the runner drops the request."""
        return self.runner.generator_state(request_id)

    def computed_prompt_blocks(self, request_id: str) -> int | None:
        """Full prompt blocks whose KV is computed so far (None: no such request)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        return min(request.num_computed_tokens, request.num_prompt_tokens) // self.config.cache.block_size

    def kv_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (also while its finished blocks are held for a transfer)."""
        return self.kv_manager.block_ids(request_id)

    def release_kv(self, request_id: str) -> int:
        """Prefill side of P/D: the KV was shipped (or the transfer cancelled): free the held blocks."""
        return self.kv_manager.release_held(request_id)

    def expire_kv_leases(self) -> None:
        self.num_lease_expired_blocks += self.kv_manager.release_expired(time.monotonic())

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced between steps (a remote prefill's first token, aborts): deliver them now rather
        than after the next step's compute."""
        outputs, self.outputs.pending = self.outputs.pending, []
        return outputs

    def load(self) -> EngineLoad:
        sched = self.scheduler
        queued = sched.queued_prefill_tokens()
        pool = self.kv_manager.pool
        return EngineLoad(sched.num_running, sched.num_waiting + len(sched.remote_waiting), queued,
                          pool.usage, pool.num_usable_blocks, pool.num_free_blocks, sched.num_preemptions,
                          self.busy.fraction(time.perf_counter()), self._prefill_rate(queued), self._host_reload_cost(),
                          self.kv_manager.stats.host_hits, pool.num_host_dropped_blocks)

    def _host_reload_cost(self) -> float:
        tier = self.runner.kv_tier
        return self.reload_cost.fraction(tier.copy_seconds_per_block) if tier is not None else 0.0

    def _prefill_rate(self, queued_tokens: int) -> float:
        if self.step_model is None:
            return 0.0
        config = self.config.scheduler
        target = config.itl_target_ms / 1000 if config.itl_target_ms is not None else None
        backlog_rate = queued_tokens / (config.ttft_target_ms / 1000) if config.ttft_target_ms is not None else 0.0
        decoding = sum(1 for r in self.scheduler.running if r.prefill_done)
        return self.step_model.prefill_tokens_per_s(decoding, target, config.max_num_batched_tokens, backlog_rate)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def bind_thread(self) -> None:
        """Make the engine's GPU the calling thread's current device (CUDA's current device is per thread)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def check_ranks(self) -> None:
        """Raise if a tensor-parallel rank is gone (health probes)."""
        self.runner.check_ranks()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        self.runner.shutdown()

    # ---- the loop ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self.expire_kv_leases()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        if self.batches is not None:
            scheduler_output, runner_output = self.batches.step(self.scheduler, self.runner)  # type: ignore[arg-type]
        else:
            scheduler_output = self.scheduler.schedule()
            runner_output = self.runner.execute_model(scheduler_output)
        expert_load = self.runner.take_expert_load()
        if expert_load is not None and expert_load.any():  # none: no forward, or one replayed from a CUDA graph
            self.stats.count_expert_load(expert_load)
        if self.proposer is not None:
            self.stats.count_spec(scheduler_output, runner_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.stats.num_steps += 1
        outputs = self.outputs.process(updated, scheduler_output, runner_output)
        ended = time.perf_counter()
        self.busy.record(started, ended)
        self._observe_step(scheduler_output, ended - started)
        self.refresh_gauges()
        return outputs

    def _observe_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """Feed the --itl-target-ms step-time model: the whole step (schedule, forward, sampling, detokenizing)
        is what a decoding request waits between two tokens. Steps that moved swapped blocks or ran nothing are
        left out (their time is not the batch's). Prefill-only steps without copies also time recomputation for
        the host tier's reload cost."""
        if (not scheduler_output.num_decode_seqs and not scheduler_output.kv_tier_copies
                and not scheduler_output.blocks_to_swap_in and not scheduler_output.blocks_to_swap_out):
            self.reload_cost.observe_prefill(scheduler_output.num_prefill_tokens, seconds)
        if self.step_model is None:
            return
        self.stats.itl_prefill_token_budget = scheduler_output.prefill_token_cap or 0
        if (scheduler_output.total_num_scheduled_tokens == 0 or scheduler_output.blocks_to_swap_in
                or scheduler_output.blocks_to_swap_out):
            return
        self.step_model.observe(scheduler_output.num_decode_seqs, scheduler_output.num_prefill_tokens, seconds,
                                scheduler_output.prefill_attention_pairs)

    def refresh_gauges(self) -> None:
        """The stats' gauges read from the scheduler and the KV pool now: after every step, and before stats are
        published while idle (an abort, a freed lease or an offload changes them without a step)."""
        s = self.stats
        s.num_requests_running = self.scheduler.num_running
        s.num_requests_waiting = self.scheduler.num_waiting
        s.num_requests_swapped = self.scheduler.num_swapped if self.scheduler.swap_space is not None else 0
        s.kv_cache_usage = self.kv_manager.usage
        s.prefix_cache_queries = self.kv_manager.stats.queries
        s.prefix_cache_hits = self.kv_manager.stats.hits
        s.external_prefix_cache_queries = self.kv_manager.stats.host_queries
        s.external_prefix_cache_hits = self.kv_manager.stats.host_hits
        s.kv_offloaded_blocks = self.kv_manager.pool.num_offloaded_blocks
        s.kv_host_dropped_blocks = self.kv_manager.pool.num_host_dropped_blocks
        tier = self.kv_manager.host_tier
        s.kv_host_cache_usage = tier.usage if tier is not None else 0.0
        s.num_preemptions = self.scheduler.num_preemptions

    def take_finished_timings(self) -> list[FinishedRequestTiming]:
        return self.outputs.take_finished_timings()
