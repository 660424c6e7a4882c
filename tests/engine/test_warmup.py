"""The kernel warm-up (engine/runner/warmup.py), forced on a CPU engine: its batches stay within the scheduler's
limits and write only the null block, and afterwards the KV cache bytes, free blocks, prefix cache, runner state,
counters and greedy outputs are what they were. (On CUDA it runs inside `ModelRunner.initialize_kv_cache`.)"""

from __future__ import annotations

import random

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.quant import quant_layers
from engine.runner.warmup import (
    DECODE_SPLITS,
    QUANT_ROWS_SCAN,
    SCRATCH_BLOCK,
    WarmupBatch,
    _quant_variants,
    model_moe_rows,
    moe_rows,
    quant_gemm_rows,
    run_batch,
    warm_up,
    warmup_batches,
)
from engine.sampling_params import SamplingParams
from kernels.fused_moe import MOE_ALIGN_TRITON_MAX_SLOTS, moe_tiles
from kernels.moe_gemv import gemv_suits
from kernels.paged_decode_attention import MIN_SPLIT_TOKENS
from kernels.quant_gemm_kn import SMEM_ENGINE_MAX_M, WGMMA_ENGINE_MAX_M
from tests.helpers.oracle import run_to_end

ARGS = dict(model="tiny", device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=1024,
            max_num_batched_tokens=512)


def make() -> LLMEngine:
    return LLMEngine(EngineArgs(**ARGS).create_engine_config())  # type: ignore[arg-type]


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in (5, 40, 300)]


def generate(engine: LLMEngine, tag: str) -> list[list[int]]:
    out = []
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        out.append(run_to_end(engine, f"{tag}{i}"))
    return out


def test_batches_cover_the_kernel_classes_within_the_limits() -> None:
    batches = warmup_batches(max_num_batched_tokens=8192, max_model_len=32768, max_num_seqs=256)
    tokens = {b.num_tokens for b in batches}
    assert {8192, 8191, 1, 3, 16, 21} <= tokens  # == 1, multiples of 16 and others, small and large
    decode_contexts = {b.seq_lens[0] for b in batches if b.query_lens == (1,)}
    assert {s * MIN_SPLIT_TOKENS for s in DECODE_SPLITS[1:]} <= decode_contexts
    assert any(q < s for b in batches for q, s in zip(b.query_lens, b.seq_lens, strict=True) if q > 1)  # extend
    small = warmup_batches(max_num_batched_tokens=64, max_model_len=600, max_num_seqs=2)
    assert all(b.num_tokens <= 64 and max(b.seq_lens) <= 600 and len(b.seq_lens) <= 2 for b in small)
    assert WarmupBatch((64,), (64,)) in small and len(set(small)) == len(small)


def test_a_batch_writes_and_reads_the_null_block_only() -> None:
    attention, positions = WarmupBatch((1, 3), (20, 3)).attention_batch(block_size=16)
    assert positions == [19, 0, 1, 2]
    assert attention.slot_mapping == [SCRATCH_BLOCK * 16 + p % 16 for p in positions]
    assert attention.block_tables == [[SCRATCH_BLOCK, SCRATCH_BLOCK], [SCRATCH_BLOCK]]


def test_a_dummy_step_writes_block_zero_and_nothing_else() -> None:
    engine = make()
    caches = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    run_batch(engine.runner, WarmupBatch((1, 20), (33, 20)))
    for (k, v), (k0, v0) in zip(engine.runner.kv_caches, caches, strict=True):
        assert not torch.equal(k[SCRATCH_BLOCK], k0[SCRATCH_BLOCK])  # the forward ran and wrote its K/V there
        assert torch.equal(k[SCRATCH_BLOCK + 1 :], k0[SCRATCH_BLOCK + 1 :])
        assert torch.equal(v[SCRATCH_BLOCK + 1 :], v0[SCRATCH_BLOCK + 1 :])


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = make()
    first = generate(engine, "a")
    assert generate(engine, "b") == first  # the second round hits the prefix cache: same tokens
    return first


def test_warm_up_leaves_the_engine_as_it_was(reference: list[list[int]]) -> None:
    engine = make()
    assert generate(engine, "a") == reference  # the prefix cache now holds these prompts' blocks
    pool, runner = engine.kv_manager.pool, engine.runner
    before = {
        "caches": [(k.clone(), v.clone()) for k, v in runner.kv_caches],
        "free": pool.num_free_blocks,
        "cached": dict(pool.cached),
        "free_order": _free_order(engine),
        "requests": dict(runner.requests),
        "generator": runner.sampler.generator.get_state().clone(),
        "stats": repr(engine.stats),
        "prefix": (engine.kv_manager.stats.queries, engine.kv_manager.stats.hits),
    }
    assert warm_up(runner) >= 0
    for (k, v), (k0, v0) in zip(runner.kv_caches, before["caches"], strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # block 0 restored, no other block touched
    assert pool.num_free_blocks == before["free"] and pool.cached == before["cached"]
    assert _free_order(engine) == before["free_order"]  # eviction order too
    assert runner.requests == before["requests"] and repr(engine.stats) == before["stats"]
    assert (engine.kv_manager.stats.queries, engine.kv_manager.stats.hits) == before["prefix"]
    assert torch.equal(runner.sampler.generator.get_state(), before["generator"])
    assert pool.take_events() == []
    assert generate(engine, "b") == reference  # prefix-cache hits and fresh blocks alike


def _free_order(engine: LLMEngine) -> list[int]:
    """The free queue's block ids, in eviction order."""
    queue = engine.kv_manager.pool.free_queue
    out, node = [], queue.head.next_free
    while node is not None and node is not queue.tail:
        out.append(node.block_id)
        node = node.next_free
    return out


def test_quant_rows_reach_every_quantized_gemm_variant() -> None:
    rows = quant_gemm_rows()
    covered = {key for m in rows for key in _quant_variants(m)}
    assert all(set(_quant_variants(m)) <= covered for m in range(1, QUANT_ROWS_SCAN + 1))
    # kn layout (kernels/quant_gemm_kn.py): GEMV; GEMM tiles of 16, 32 and 64 rows (one or two row tiles) on and
    # off a multiple of 16; dequantize + cuBLAS from 128 rows. Canonical fp32 GEMV row blocks of 1, 2, 4 and 8.
    assert {1, 2, 3, 5, 9, 16, 17, 32, 33, 48, 65, 80, 128, 129} <= set(rows)
    tokens = {b.num_tokens for b in warmup_batches(max_num_batched_tokens=8192, max_model_len=32768, max_num_seqs=256)}
    assert set(rows) <= tokens


def test_quant_rows_reach_the_shared_memory_wgmma_variants() -> None:
    """WGMMA_ENGINE_MAX_M + 1 to SMEM_ENGINE_MAX_M rows take kernels/quant_wgmma_smem.py (compiled per tile, split
    or not, M's divisibility by 16), more the dense path: the scanned row counts reach every variant."""
    assert WGMMA_ENGINE_MAX_M < SMEM_ENGINE_MAX_M < QUANT_ROWS_SCAN
    assert [key for key in _quant_variants(200) if key[0] == "kn_smem"]
    assert [key for key in _quant_variants(SMEM_ENGINE_MAX_M) if key[0] == "kn_smem"]
    assert not [key for key in _quant_variants(WGMMA_ENGINE_MAX_M) if key[0] == "kn_smem"]
    assert not [key for key in _quant_variants(SMEM_ENGINE_MAX_M + 1) if key[0] == "kn_smem"]
    covered = {key for m in quant_gemm_rows() for key in _quant_variants(m)}
    assert all(set(_quant_variants(m)) <= covered for m in range(1, QUANT_ROWS_SCAN + 1))


def test_warm_up_runs_the_quantized_linears_at_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU dummy-GGUF engine (Q4_1 linears, Q8_0 head): the row counts each quantized product met."""
    engine = LLMEngine(EngineArgs(model="tiny-llama", load_format="dummy", quantization="gguf", device="cpu",
                                  kv_cache_memory_bytes=16 << 20, max_model_len=1024, max_num_batched_tokens=512,
                                  max_num_seqs=64).create_engine_config())
    seen: dict[int, set[int]] = {}  # out_features -> row counts
    real = quant_layers.quant_matmul

    def record(x: torch.Tensor, w, use_kernel: bool = True) -> torch.Tensor:  # noqa: ANN001
        seen.setdefault(w.out_features, set()).add(x.shape[0])
        return real(x, w, use_kernel)

    monkeypatch.setattr(quant_layers, "quant_matmul", record)
    warm_up(engine.runner)
    arch = engine.config.model.arch
    decoder = seen[arch.hidden_size]  # o_proj and down_proj
    assert set(quant_gemm_rows()) <= decoder
    assert {r for r in quant_gemm_rows() if r <= 64} <= seen[arch.vocab_size]  # the quantized head, up to max_num_seqs


def test_moe_rows_reach_every_expert_kernel_variant() -> None:
    """Qwen3-30B-A3B's 128 experts, top-8: the per-slot GEMVs (1 token), then the grouped GEMMs' 16-, 32- and
    64-row tiles, with the Triton alignment up to 4096 slots and the torch one past it; expert parallelism over
    two ranks (64 experts each) moves the tile classes' bounds."""
    assert moe_rows(128, 8, ((128, 768),), 8192) == (1, 9, 257, 513, 1025)
    assert moe_rows(128, 8, ((64, 768),), 8192) == (1, 9, 129, 513)
    assert moe_rows(128, 8, ((128, 768),), 300) == (1, 9, 257)  # nothing past the largest step
    slots_by_key: dict[tuple[object, ...], set[int]] = {}
    for tokens in range(1, 2049):  # every count's variant is one a warmed count selects
        slots = tokens * 8
        key = ("gemv",) if gemv_suits(slots, 128) else (moe_tiles(slots, 128), slots <= MOE_ALIGN_TRITON_MAX_SLOTS)
        slots_by_key.setdefault(key, set()).add(tokens)
    assert all(set(moe_rows(128, 8, ((128, 768),), 2048)) & tokens for tokens in slots_by_key.values())


def test_moe_warm_up_rows_come_from_the_config() -> None:
    config = EngineArgs(model="tiny-qwen3-moe", load_format="dummy", device="cpu", max_model_len=1024,
                        max_num_batched_tokens=1024).create_engine_config()
    moe = config.model.arch.moe
    assert moe is not None
    rows = model_moe_rows(config)
    assert rows == moe_rows(moe.num_experts, moe.top_k, ((moe.num_experts, moe.expert_intermediate_size),), 1024)
    assert rows[0] == 1
    tokens = {b.num_tokens for b in warmup_batches(1024, 1024, 256, rows)}
    assert set(rows) <= tokens
    assert model_moe_rows(EngineArgs(**ARGS).create_engine_config()) == ()  # type: ignore[arg-type]
