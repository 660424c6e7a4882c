"""The compiled CPU prefill-attention kernel (kernels/cpu/prefill_attention.cpp) against a float64 reference and
torch's SDPA path: fresh prompts, ragged lengths, prompts continuing a cached prefix, GQA groups, strided queries."""

from __future__ import annotations

import pytest
import torch

from engine.runner.attention import AttentionBatch, TorchAttentionMetadata, TorchPagedAttention
from kernels.cpu_prefill_attention import SWITCH_ENV, load_prefill_extension, prefill_attention_kernel

TOLERANCE = 1e-5  # relative (Frobenius) error; fp32 accumulation lands at ~1e-7 here


def test_kernel_is_built_here() -> None:
    # CI machines have a compiler: a missing kernel would silently cost the CPU benchmark its speed.
    assert load_prefill_extension() is not None


def reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: list[list[int]],
              query_lens: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
    """Causal GQA attention in float64, one sequence at a time, keys gathered block by block."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = q.shape[1] // num_kv_heads
    out, start = [], 0
    for table, q_len, seq_len in zip(tables, query_lens, seq_lens, strict=True):
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(seq_len)])
        keys = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        values = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        queries = q[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += q_len
    return torch.cat(out)


def make_case(gen: torch.Generator, query_lens: list[int], cached: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch]:
    """A shuffled paged cache holding every sequence's context, and queries as a strided view into a fused qkv
    (as the engine passes them)."""
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0 (padding)
    tables, slots = [], []
    for n_blocks, c, s in zip(per_seq, cached, seq_lens, strict=True):
        table, ids = ids[:n_blocks], ids[n_blocks:]
        tables.append(table)
        slots += [table[t // block_size] * block_size + t % block_size for t in range(c, s)]
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    return q, key_cache, value_cache, AttentionBatch(query_lens, seq_lens, tables, slots)


CASES = {
    # name: query lengths, cached prefix lengths, heads, kv heads, head_dim, block size
    "smollm2_fresh_b8_l128": ([128] * 8, [0] * 8, 9, 3, 64, 16),
    "smollm2_fresh_b2_l512": ([512] * 2, [0] * 2, 9, 3, 64, 16),
    "smollm2_fresh_l2048": ([2048], [0], 9, 3, 64, 16),
    "smollm2_ragged": ([2, 17, 130, 64, 255, 3], [0] * 6, 9, 3, 64, 16),
    "smollm2_prefix_continuation": ([256, 40, 7, 129], [256, 1000, 33, 16], 9, 3, 64, 16),
    "smollm2_chunk_after_long_prefix": ([512], [1536], 9, 3, 64, 16),
    "mixed_fresh_and_cached": ([100, 50, 2], [0, 77, 300], 9, 3, 64, 16),
    "llama_shapes_d128": ([70, 33], [0, 20], 8, 2, 128, 16),
    "mha_d32_block8": ([45, 9], [3, 0], 4, 4, 32, 8),
    "group7_qwen2_shapes": ([90, 31], [0, 64], 14, 2, 64, 16),
    "group_wider_than_a_task": ([5, 3], [2, 0], 80, 1, 16, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_float64_reference_and_sdpa_path(name: str) -> None:
    query_lens, cached, num_heads, num_kv_heads, head_dim, block_size = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    q, key_cache, value_cache, batch = make_case(gen, query_lens, cached, num_heads, num_kv_heads, head_dim,
                                                 block_size)
    scale = head_dim ** -0.5
    backend = TorchPagedAttention(block_size)
    assert backend.cpu_prefill_kernel is not None
    meta = backend.build_metadata(batch, torch.device("cpu"))
    assert isinstance(meta, TorchAttentionMetadata) and meta.prefill is not None
    ours = backend._attend_cached(q, (key_cache, value_cache), meta, scale)  # the kernel (q_len > 1 rows)
    expected = reference(q, key_cache, value_cache, batch.block_tables, query_lens, batch.seq_lens, scale)
    assert ((ours.double() - expected).norm() / expected.norm()).item() < TOLERANCE

    # torch's SDPA path for the same rows (query-length-1 rows go to the decode kernel either way)
    backend.cpu_prefill_kernel = None
    sdpa = backend._attend_cached(q, (key_cache, value_cache), meta, scale)
    prefill_rows = meta.prefill.flat_rows
    assert ((ours[prefill_rows] - sdpa[prefill_rows]).norm() / sdpa[prefill_rows].norm()).item() < TOLERANCE


FP8_CASES = ["smollm2_ragged", "smollm2_prefix_continuation", "llama_shapes_d128", "group_wider_than_a_task"]


@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_caches_match_the_reference_of_their_values(name: str) -> None:
    """e4m3 caches (value / scale): the kernel widens them itself and applies both scales; it matches the float64
    reference of the widened values and torch's path, and a scale left out would be off by 4x or 0.5x."""
    from kernels.fp8_kv import dequantize_fp8, quantize_fp8

    query_lens, cached, num_heads, num_kv_heads, head_dim, block_size = CASES[name]
    gen = torch.Generator().manual_seed(len(name) + 1)
    q, key_cache, value_cache, batch = make_case(gen, query_lens, cached, num_heads, num_kv_heads, head_dim,
                                                 block_size)
    k_scale, v_scale = 4.0, 0.5
    k8, v8 = quantize_fp8(key_cache * 8, k_scale), quantize_fp8(value_cache, v_scale)
    scale = head_dim ** -0.5
    backend = TorchPagedAttention(block_size)
    meta = backend.build_metadata(batch, torch.device("cpu"))
    assert meta.prefill is not None and backend._prefill_kernel_fits(q, k8)
    ours = backend._attend_cached(q, (k8, v8), meta, scale, (k_scale, v_scale))
    expected = reference(q, dequantize_fp8(k8, k_scale, torch.float32), dequantize_fp8(v8, v_scale, torch.float32),
                         batch.block_tables, query_lens, batch.seq_lens, scale)
    assert ((ours.double() - expected).norm() / expected.norm()).item() < TOLERANCE
    backend.cpu_prefill_kernel = None
    torch_path = backend._attend_cached(q, (k8, v8), meta, scale, (k_scale, v_scale))
    rows = meta.prefill.flat_rows
    assert ((ours[rows] - torch_path[rows]).norm() / torch_path[rows].norm()).item() < TOLERANCE


def test_contiguous_and_strided_queries_agree() -> None:
    gen = torch.Generator().manual_seed(1)
    q, key_cache, value_cache, batch = make_case(gen, [37, 64], [0, 5], 9, 3, 64, 16)
    assert not q.is_contiguous()
    backend = TorchPagedAttention(16)
    meta = backend.build_metadata(batch, torch.device("cpu"))
    strided = backend._attend_cached(q, (key_cache, value_cache), meta, 0.125)
    assert torch.equal(strided, backend._attend_cached(q.contiguous(), (key_cache, value_cache), meta, 0.125))


def test_bad_inputs_raise_instead_of_reading_out_of_bounds() -> None:
    kernel = load_prefill_extension()
    assert kernel is not None
    gen = torch.Generator().manual_seed(2)
    key_cache = torch.randn(4, 16, 3, 64, generator=gen)
    value_cache = torch.randn_like(key_cache)
    q = torch.randn(20, 9, 64, generator=gen)
    out = torch.empty_like(q)
    one = torch.tensor([0])

    def call(tables: list[list[int]], q_len: int, seq_len: int, start: torch.Tensor = one) -> None:
        kernel.prefill_attention(q, key_cache, value_cache, torch.tensor(tables), start, torch.tensor([q_len]),
                                 torch.tensor([seq_len]), 0.125, out)

    call([[1, 2]], 20, 20)  # valid
    with pytest.raises(RuntimeError, match="block id outside"):
        call([[1, 4]], 20, 20)
    with pytest.raises(RuntimeError, match="query_len <= seq_len"):
        call([[1, 2]], 20, 19)
    with pytest.raises(RuntimeError, match="capacity"):
        call([[1, 2]], 20, 33)
    with pytest.raises(RuntimeError, match="query rows outside"):
        call([[1, 2]], 20, 20, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.prefill_attention(q.double(), key_cache, value_cache, torch.tensor([[1, 2]]), one,
                                 torch.tensor([20]), torch.tensor([20]), 0.125, out)


def test_switch_keeps_the_sdpa_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert prefill_attention_kernel() is None and TorchPagedAttention(16).cpu_prefill_kernel is None
    monkeypatch.setenv(SWITCH_ENV, "1")
    assert TorchPagedAttention(16).cpu_prefill_kernel is not None
    monkeypatch.setenv(SWITCH_ENV, "off")
    with pytest.raises(ValueError, match=SWITCH_ENV):
        prefill_attention_kernel()
