"""Model runner: owns the device, the weights and the KV cache; turns a `SchedulerOutput` into sampled tokens.

It keeps per-request sampling state (sent once as `NewRequestData`) and gets only token ids, positions and
block tables each step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import AttentionBatch, KVCache, TorchPagedAttention
from engine.config import EngineConfig
from engine.models.llama import CausalLM
from engine.models.loader import hf_state_dict
from engine.outputs import ModelRunnerOutput, PositionLogprobs, SchedulerOutput
from engine.sampler import Sampler, SamplingRow, gather_logprobs
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 4 << 30  # vLLM's CPU backend default KV space


@dataclass
class RunnerRequestState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        self.dtype = DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.attn_backend = TorchPagedAttention(self.block_size)
        started = time.perf_counter()
        torch.manual_seed(config.model.seed)
        with torch.device(self.device):
            model = CausalLM(arch, config.model.hf_config, self.attn_backend, config.model.max_model_len)
        if config.model.load_format == "dummy":
            model.init_dummy_weights(config.model.seed)
        else:
            assert config.model.model_path is not None
            model.load_hf_state_dict(hf_state_dict(config.model.model_path))
        self.model = model.to(self.dtype).eval()
        self.model.rotary.to(torch.float32)  # cos/sin cache stays fp32, cast per use
        logger.info("loaded %s (%.1fM params, %s) in %.1fs", config.model.model, arch.num_params / 1e6,
                    config.model.dtype, time.perf_counter() - started)
        self.sampler = Sampler(config.model.seed, self.device)
        self.requests: dict[str, RunnerRequestState] = {}
        self.kv_caches: list[KVCache] = []
        self.swap_caches: list[KVCache] = []

    # ---- KV cache ----------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        arch = self.config.model.arch
        return self.block_size * arch.kv_bytes_per_token(self.dtype.itemsize)

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
        return num_blocks

    def _profile_free_gpu_memory(self) -> int:
        """Bytes left for KV after weights and the peak activation of a max_num_batched_tokens forward pass."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        blocks = tokens // self.block_size + 2
        self.initialize_kv_cache(blocks, 0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        from engine.outputs import ScheduledChunk

        profile = SchedulerOutput(
            new_requests=[], chunks=[ScheduledChunk("__profile__", [0] * tokens, 0, list(range(1, blocks)),
                                                    True, False)],
            total_num_scheduled_tokens=tokens,
        )
        self.requests["__profile__"] = RunnerRequestState(SamplingParams(), [0] * tokens)
        self.execute_model(profile)
        self.requests.pop("__profile__")
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = total * cache.gpu_memory_utilization - peak - max(used_by_others, 0)
        logger.info("memory profile: total %.1f GiB, peak torch %.2f GiB, KV budget %.2f GiB",
                    total / 2**30, peak / 2**30, budget / 2**30)
        return int(max(budget, 0))

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        arch = self.config.model.arch
        shape = (num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        # Zeroed: padding slots are read (then masked), and 0 * garbage could be NaN.
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(arch.num_layers)
        ]
        swap_shape = (num_swap_blocks, *shape[1:])
        pin = self.device.type == "cuda"
        self.swap_caches = [
            (torch.zeros(swap_shape, dtype=self.dtype, pin_memory=pin),
             torch.zeros(swap_shape, dtype=self.dtype, pin_memory=pin))
            for _ in range(arch.num_layers)
        ] if num_swap_blocks else []

    def _swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        src_ids = torch.as_tensor([p[0] for p in pairs], dtype=torch.int64)
        dst_ids = torch.as_tensor([p[1] for p in pairs], dtype=torch.int64)
        for (dev_k, dev_v), (cpu_k, cpu_v) in zip(self.kv_caches, self.swap_caches, strict=True):
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
            seed = new.sampling_params.seed
            generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
            self.requests[new.request_id] = RunnerRequestState(new.sampling_params, new.prompt_token_ids,
                                                               generator=generator)
        self._swap(so.blocks_to_swap_out, to_cpu=True)
        self._swap(so.blocks_to_swap_in, to_cpu=False)
        if not so.chunks:
            return ModelRunnerOutput({})

        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, block_tables = [], [], []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        prompt_lp_spans: list[tuple[str, int, int, int]] = []  # (request, first row, num rows, start pos)
        row = 0
        bs = self.block_size
        for chunk in so.chunks:
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
            if chunk.sample:
                sample_rows.append(row + n - 1)
                sample_ids.append(chunk.request_id)
            row += n

        device = self.device
        meta = self.attn_backend.build_metadata(
            AttentionBatch(query_lens, seq_lens, block_tables, slots), device)
        hidden = self.model(
            torch.as_tensor(input_ids, dtype=torch.int64, device=device),
            torch.as_tensor(positions, dtype=torch.int64, device=device),
            self.kv_caches, meta,
        )
        prompt_logprobs = self._prompt_logprobs(hidden, prompt_lp_spans)
        if not sample_rows:
            return ModelRunnerOutput({}, {}, prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.as_tensor(sample_rows, device=device)])
        states = [self.requests[rid] for rid in sample_ids]
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in states]
        tokens = self.sampler.sample(logits, rows)
        logprobs: dict[str, PositionLogprobs] = {}
        wants = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if wants:
            index = torch.as_tensor(wants, device=device)
            entries = gather_logprobs(logits[index].log_softmax(dim=-1), tokens[index],
                                      [states[i].params.logprobs or 0 for i in wants])
            logprobs = {sample_ids[i]: entry for i, entry in zip(wants, entries, strict=True)}
        token_list = tokens.tolist()  # the step's one host sync
        for state, token in zip(states, token_list, strict=True):
            state.output_token_ids.append(token)
        return ModelRunnerOutput(dict(zip(sample_ids, token_list, strict=True)), logprobs, prompt_logprobs)

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
