"""Kernel warm-up: run every kernel variant a GPU worker will use once, before the worker says it is ready.

Why: Triton compiles a kernel the first time it meets a new specialization: its constexprs (an fp8 cache, the
decode kernel's split-count class) and Triton's own specialization of integer arguments (== 1, a multiple of 16:
token and row counts) and of pointer alignment. A compile takes from a fraction of a second to seconds, so a
first batch of a new shape ran at half the speed of the same batch a minute later. cuBLAS picks its kernels
lazily too. The engine builds (and the worker's health answers only after) `LLMEngine` construction, which calls
`ModelRunner.initialize_kv_cache`, which runs this after the KV cache is allocated and the decode graphs are
captured (the graphs warmed the decode-only replays; this covers the eager steps).

What runs (`warmup_batches`): eager forwards of the runner's own model and attention backend, plus the lm head,
over dummy tokens (id 0): the largest prefill chunk and one token less (token counts that are and are not
multiples of 16), a small prompt, a chunk continuing a cached prefix, eager decode batches of 1 and 3 rows, mixed
decode + prefill steps of 16 and 21 tokens, one decode row at each context that selects another split-count
class of the decode kernel (kernels/paged_decode_attention.py), and a prompt of every row count that selects
another compiled variant of the quantized GEMMs (`quant_gemm_rows`: tile classes, row-tile counts, M on or off a
multiple of 16), whose counts the lm head also runs once; for an MoE model, a prompt of every token count that
selects another compiled variant of its expert kernels (`moe_rows`). No sampling.

Invariants:
- Every K/V write goes to block 0, the null block that pads block tables and is never handed out, and every
  block table lists only block 0; block 0 of every layer is saved before and restored after. So the cache's
  bytes, the KV cache manager, the prefix cache, the runner's requests, the sampler's generators and every
  counter and metric are exactly as before.
- No forward holds more than max_num_batched_tokens tokens or a context over max_model_len: the memory profile
  covered every one.
- The batches depend on the config alone, so tensor-parallel ranks (each runs this in its own
  `initialize_kv_cache`) run the same forwards and their collectives pair up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.parallel.layout import shard_for
from engine.runner.attention import AttentionBatch
from kernels.fused_moe import MOE_ALIGN_TRITON_MAX_SLOTS
from kernels.moe_gemv import gemv_suits
from kernels.moe_tiles import select_tiles
from kernels.paged_decode_attention import MIN_SPLIT_TOKENS
from kernels.quant_gemm import GEMV_MAX_M, gemm_tiles, gemv_tiles
from kernels.quant_gemm_kn import (
    DEQUANT_MIN_M,
    MMA_MAX_M,
    REGS_ENGINE_MAX_M,
    REGS_FALLBACK_MAX_M,
    SMEM_ENGINE_MAX_M,
    WGMMA_ENGINE_MAX_M,
    kn_gemm_tiles,
)
from kernels.quant_mma_regs import regs_block_m
from kernels.quant_wgmma import wgmma_entry, wgmma_tiles
from kernels.quant_wgmma_smem import smem_tiles

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.models.llama import CausalLM
    from engine.parallel.stages import PipelineStage
    from engine.runner.attention import AttentionBackend, KVCache

logger = logging.getLogger(__name__)


class WarmupRunner(Protocol):
    """What the warm-up reads of the `ModelRunner` (engine/runner/model_runner.py) that runs it."""

    config: EngineConfig
    device: torch.device
    block_size: int
    on_cuda: bool
    stage: PipelineStage
    model: CausalLM
    attn_backend: AttentionBackend
    kv_caches: list[KVCache]

SCRATCH_BLOCK = 0  # the null block: pads block tables, never handed out to a request
# Split counts of the decode kernel, one per compiled class: next_pow2(splits) is a constexpr, and Triton
# specializes the count itself on being 1 or a multiple of 16.
DECODE_SPLITS = (1, 2, 3, 5, 9, 16, 17, 32, 33, 48)
SAMPLE_ROWS = (1, 3, 16)  # lm-head row counts: one, another, a multiple of 16
# The quantized GEMMs' variants are enumerated up to this many rows (past the shared-memory wgmma kernel's last):
# above it only the kn layout's dense path and the canonical GEMM's widest tile run, neither compiling anything new
# by row count. Their tile choice depends on the rows alone; the nominal width and SM count below only fill the
# arguments.
QUANT_ROWS_SCAN = max(256, SMEM_ENGINE_MAX_M + 1)
_NOMINAL_WIDTH, _NOMINAL_SMS = 4096, 132


@dataclass(frozen=True)
class WarmupBatch:
    """One dummy step: per sequence, its new tokens and its context after the step (decodes first)."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def attention_batch(self, block_size: int) -> tuple[AttentionBatch, list[int]]:
        """The attention batch (every table and every write on the scratch block) and the tokens' positions."""
        positions = [p for q, s in zip(self.query_lens, self.seq_lens, strict=True) for p in range(s - q, s)]
        tables = [[SCRATCH_BLOCK] * -(-s // block_size) for s in self.seq_lens]
        slots = [SCRATCH_BLOCK * block_size + p % block_size for p in positions]
        return AttentionBatch(list(self.query_lens), list(self.seq_lens), tables, slots), positions


def _quant_variants(m: int) -> list[tuple[object, ...]]:
    """The compiled variants an m-row product selects in kernels/quant_gemm_kn.py (4-bit weights on CUDA) and
    kernels/quant_gemm.py (8-bit weights and quantized heads; both product dtypes), M's divisibility by 16 (which
    Triton specializes) included where M is a kernel argument."""
    n = k = _NOMINAL_WIDTH
    by16 = m % 16 == 0
    if m == 1:
        keys: list[tuple[object, ...]] = [("kn_gemv",)]
    elif m >= DEQUANT_MIN_M:
        keys = [("kn_dense", by16)]  # one dequantization launch, then cuBLAS (which picks kernels by shape)
    else:  # the row-tile count sets the K split, and the split count is the split-sum kernel's constexpr
        block_m, block_n, block_r, warps, swap, _ = kn_gemm_tiles(m, n, k, _NOMINAL_SMS)
        keys = [("kn_gemm", block_m, block_n, block_r, warps, swap, -(-m // block_m), by16)]
        if m <= MMA_MAX_M:  # 16-bit activations over groups of 128 (AWQ / GPTQ) take the tensor-core kernel
            keys.append(("kn_mma", by16))
    # 16-bit activations over groups of 128: the Gluon regs kernel (compiled per padded row count, and M == 1
    # specialized) up to REGS_FALLBACK_MAX_M rows, on sm_90 only up to REGS_ENGINE_MAX_M; past that Hopper's wgmma
    # kernel (compiled per tile, row tile, split or not and options)
    if m <= REGS_FALLBACK_MAX_M:
        keys.append(("kn_regs", regs_block_m(m), m == 1))
    if REGS_ENGINE_MAX_M < m <= WGMMA_ENGINE_MAX_M:
        groups, per_group, block_m, split, _ = wgmma_tiles(m, n, k, _NOMINAL_SMS)
        keys.append(("kn_wgmma", groups, per_group, block_m, split > 1, *wgmma_entry(m)[4:], by16))
    elif WGMMA_ENGINE_MAX_M < m <= SMEM_ENGINE_MAX_M:
        block_m, block_n, warps, stages, split, _ = smem_tiles(m, n, k, _NOMINAL_SMS)
        keys.append(("kn_smem", block_m, block_n, warps, stages, split > 1, by16))
    for upcast in (False, True):  # 16-bit products; fp32 ones (and GPUs without 16-bit dots)
        if m == 1 or (upcast and m <= GEMV_MAX_M):
            keys.append(("gemv", gemv_tiles(m, n, k, _NOMINAL_SMS)[0]))
        else:
            keys.append(("gemm", upcast, *gemm_tiles(m, n, k, _NOMINAL_SMS, upcast)[:3], by16))
    return keys


def quant_gemm_rows(limit: int = QUANT_ROWS_SCAN) -> tuple[int, ...]:
    """Row counts (a step's tokens, or the head's rows) that reach every row-dependent compiled variant of the
    quantized GEMMs: the first count selecting each (`_quant_variants`). fp8 W8A8 needs none of its own: its
    activation quantization (kernels/fp8_quant.py) runs a row per program and compiles once per width, and
    torch._scaled_mm is cuBLAS."""
    first: dict[tuple[object, ...], int] = {}
    for m in range(1, limit + 1):
        for key in _quant_variants(m):
            first.setdefault(key, m)
    return tuple(sorted(set(first.values())))


def moe_rows(num_experts: int, top_k: int, shapes: tuple[tuple[int, int], ...], limit: int,
             device: torch.device = torch.device("cpu")) -> tuple[int, ...]:
    """Token counts that reach every compiled variant of an MoE layer's expert kernels (engine/models/moe.py
    `_fused_experts`): the first count taking the per-slot GEMVs, and the first taking each tiling of the grouped
    GEMMs (kernels/moe_tiles.py `select_tiles` on `device`, for every rank's (experts, intermediate size) in
    `shapes`) with the Triton or the torch alignment. Their batch-size arguments are not specialized, so nothing
    else varies."""
    first: dict[tuple[object, ...], int] = {}
    for tokens in range(1, limit + 1):
        slots = tokens * top_k
        if gemv_suits(slots, num_experts):
            first.setdefault(("gemv",), tokens)
            continue
        for experts, inter in shapes:
            tiles = select_tiles(tokens, top_k, experts, inter, device)
            first.setdefault((tiles, slots <= MOE_ALIGN_TRITON_MAX_SLOTS), tokens)
    return tuple(sorted(set(first.values())))


def model_moe_rows(config: EngineConfig, device: torch.device = torch.device("cpu")) -> tuple[int, ...]:
    """`moe_rows` for the config's model (none for a dense one), up to its largest step. Every rank derives the
    same list from the config (and its GPU model, the same on every rank), every rank's expert shape included, so
    their collectives pair up."""
    moe = config.model.arch.moe
    if moe is None:
        return ()
    tp = config.device.tensor_parallel_size
    shards = [shard_for(config.model.arch, rank, tp, config.device.enable_expert_parallel) for rank in range(tp)]
    shapes = {(s.experts[1] - s.experts[0], s.expert_intermediate_size) for s in shards}
    return moe_rows(moe.num_experts, moe.top_k, tuple(sorted(shapes)), config.scheduler.max_num_batched_tokens,
                    device)


def warmup_batches(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                   extra_rows: tuple[int, ...] = ()) -> list[WarmupBatch]:
    """The dummy steps, within the scheduler's limits (see the module docstring); `extra_rows`: prompts of these
    token counts too (an MoE model's `model_moe_rows`)."""
    chunk = min(max_num_batched_tokens, max_model_len)
    wanted = [
        WarmupBatch((chunk,), (chunk,)),
        WarmupBatch((chunk - 1,), (chunk - 1,)),
        WarmupBatch((17,), (17,)),
        WarmupBatch((16,), (48,)),  # a chunk after a cached prefix
        WarmupBatch((1,), (9,)),
        WarmupBatch((1, 1, 1), (5, 40, 300)),
        WarmupBatch((1, 1, 14), (12, 70, 14)),  # 16 tokens
        WarmupBatch((1, 20), (33, 20)),  # 21 tokens
    ]
    wanted += [WarmupBatch((1,), (splits * MIN_SPLIT_TOKENS,)) for splits in DECODE_SPLITS[1:]]
    tokens = {b.num_tokens for b in wanted}
    wanted += [WarmupBatch((rows,), (rows,)) for rows in (*quant_gemm_rows(), *extra_rows) if rows not in tokens]
    batches = []
    for batch in wanted:
        fits = (1 <= batch.num_tokens <= max_num_batched_tokens and len(batch.query_lens) <= max_num_seqs
                and max(batch.seq_lens) <= max_model_len and min(batch.query_lens) >= 1)
        if fits and batch not in batches:
            batches.append(batch)
    return batches


def warm_up(runner: WarmupRunner) -> float:
    """Run `warmup_batches` on the runner's model; the seconds it took. See the module docstring."""
    sched = runner.config.scheduler
    batches = warmup_batches(sched.max_num_batched_tokens, runner.config.model.max_model_len, sched.max_num_seqs,
                             model_moe_rows(runner.config, runner.device))
    started = time.perf_counter()
    saved = [(k[SCRATCH_BLOCK].clone(), v[SCRATCH_BLOCK].clone()) for k, v in runner.kv_caches]
    # the lm head's row counts: the quantized GEMMs' variants once (on the largest batch), SAMPLE_ROWS on each
    head_rows = sorted(set(SAMPLE_ROWS) | {r for r in quant_gemm_rows() if r <= sched.max_num_seqs})
    try:
        with torch.inference_mode():
            for i, batch in enumerate(batches):
                run_batch(runner, batch, tuple(head_rows) if i == 0 else SAMPLE_ROWS)
    finally:
        for (key, value), (saved_key, saved_value) in zip(runner.kv_caches, saved, strict=True):
            key[SCRATCH_BLOCK].copy_(saved_key)
            value[SCRATCH_BLOCK].copy_(saved_value)
        if runner.on_cuda:
            torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - started
    logger.info("warmed the kernels with %d dummy steps (up to %d tokens) in %.1fs", len(batches),
                max(b.num_tokens for b in batches), seconds)
    return seconds


def run_batch(runner: WarmupRunner, batch: WarmupBatch, head_rows: tuple[int, ...] = SAMPLE_ROWS) -> None:
    """One dummy step: the forward and the lm head at `head_rows` rows (block 0 is left written)."""
    attention, positions = batch.attention_batch(runner.block_size)
    device = runner.device
    ids = torch.zeros(len(positions), dtype=torch.int64, device=device)
    meta = runner.attn_backend.build_metadata(attention, device)
    hidden = runner.model(ids, torch.as_tensor(positions, dtype=torch.int64, device=device), runner.kv_caches, meta)
    if not runner.stage.is_last:  # a pipeline stage before the last has no head
        return
    for rows in head_rows:
        if rows <= len(hidden):
            runner.model.compute_logits(hidden[:rows])
