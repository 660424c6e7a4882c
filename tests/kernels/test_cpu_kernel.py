"""The compiled CPU decode-attention kernel equals the torch path and the kernels/ reference."""

from __future__ import annotations

import pytest
import torch

from engine.runner.attention import AttentionBatch, TorchPagedAttention
from kernels.cpu_decode_attention import load_extension, paged_decode_attention_cpu
from kernels.paged_decode_attention import paged_decode_attention_ref


def test_kernel_is_built_here() -> None:
    # CI machines have a compiler: a missing kernel would silently cost the CPU benchmark its speed.
    assert load_extension() is not None


def test_cpu_kernel_matches_reference_and_torch_path() -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_heads = 40, 8, 2, 32, 6
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    seq_lens = torch.tensor([1, 9, 33, 17])
    tables = torch.randperm(num_blocks - 1, generator=gen)[:4 * 5].view(4, 5) + 1  # shuffled, never block 0
    query = torch.randn(4, num_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    ours = paged_decode_attention_cpu(query, key_cache, value_cache, tables, seq_lens, scale)
    reference = paged_decode_attention_ref(query, key_cache, value_cache, tables.to(torch.int32),
                                           seq_lens.to(torch.int32), scale)
    assert (ours - reference).norm() / reference.norm() < 1e-5

    backend = TorchPagedAttention(block_size)
    batch = AttentionBatch([1] * 4, seq_lens.tolist(), [t.tolist() for t in tables], [0] * 4)
    meta = backend.build_metadata(batch, torch.device("cpu"))
    torch_out = torch.full_like(query, float("nan"))
    assert meta.decode is not None
    backend._attend(query, key_cache, value_cache, meta.decode, scale, torch_out)
    assert (ours - torch_out).norm() / torch_out.norm() < 1e-5


@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 32), (1, 12)])  # (1, 12): rows of 12 codes, widened
def test_cpu_kernel_reads_fp8_caches_with_their_scales(num_kv_heads: int, head_dim: int) -> None:  # past vectors
    """An e4m3 cache (value / scale) is read in the kernel as bytes: equal to the reference and to the torch path
    that widens gathered blocks, at scales other than 1 (a scale left out would be off by 4x and 0.5x)."""
    from kernels.fp8_kv import FP8_DTYPE, quantize_fp8

    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_heads = 40, 8, 6
    k_scale, v_scale = 4.0, 0.5
    key_cache = quantize_fp8(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 9, k_scale)
    value_cache = quantize_fp8(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen), v_scale)
    assert key_cache.dtype == FP8_DTYPE
    seq_lens = torch.tensor([1, 9, 33, 17, 40])
    tables = torch.randperm(num_blocks - 1, generator=gen)[:5 * 5].view(5, 5) + 1
    query = torch.randn(5, num_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    reference = paged_decode_attention_ref(query, key_cache, value_cache, tables.to(torch.int32),
                                           seq_lens.to(torch.int32), scale, k_scale=k_scale, v_scale=v_scale)
    backend = TorchPagedAttention(block_size)
    assert backend.cpu_decode_kernel is not None
    batch = AttentionBatch([1] * 5, seq_lens.tolist(), [t.tolist() for t in tables], [0] * 5)
    meta = backend.build_metadata(batch, torch.device("cpu"))
    assert meta.decode is not None
    ours = backend._attend_cached(query, (key_cache, value_cache), meta, scale, (k_scale, v_scale))
    assert (ours - reference).norm() / reference.norm() < 1e-5
    torch_out = torch.full_like(query, float("nan"))
    backend._attend(query, key_cache, value_cache, meta.decode, scale, torch_out, k_scale, v_scale)
    assert (ours - torch_out).norm() / torch_out.norm() < 1e-5


def test_rotary_kv_write_is_bit_identical_to_the_torch_path() -> None:
    """The fused pass must equal `RotaryEmbedding.rotate` + `index_copy_` exactly (the engine stays token-exact)."""
    from types import SimpleNamespace

    from engine.models.llama import RotaryEmbedding
    from kernels.cpu_rotary_kv_write import load_rotary_extension

    assert load_rotary_extension() is not None
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 12
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=100000.0), head_dim, 256)
    for num_tokens in (1, 7, 40):  # one thread for small batches, several tasks for larger ones
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3
        positions = torch.randint(0, 256, (num_tokens,), generator=gen)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(4)]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        expected = rotary.rotate(positions, qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim))
        caches[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, expected[:, num_heads:])
        caches[1].view(-1, num_kv_heads, head_dim).index_copy_(
            0, slots, qkv[:, q_size + kv_size :].reshape(num_tokens, num_kv_heads, head_dim))
        fused = qkv.clone()
        load_rotary_extension().rotary_kv_write(fused, positions, rotary.cos_half, rotary.sin_half, caches[2],
                                                caches[3], slots, num_heads, num_kv_heads)
        assert torch.equal(fused[:, : q_size + kv_size].view(num_tokens, -1, head_dim), expected)
        assert torch.equal(fused[:, q_size + kv_size :], qkv[:, q_size + kv_size :])  # v untouched
        assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_rotary_kv_write_into_fp8_is_bit_identical_to_the_torch_path() -> None:
    """Into an e4m3 cache the fused pass stores exactly `quantize_fp8(rotated k, k_scale)` and
    `quantize_fp8(v, v_scale)`: values on the grid, half-way between grid points (ties to even), just either side
    of them, subnormals, signed zeros and values far beyond 448 (saturated)."""
    from types import SimpleNamespace

    from engine.models.llama import RotaryEmbedding
    from kernels.cpu_rotary_kv_write import load_rotary_extension
    from kernels.fp8_kv import FP8_DTYPE, quantize_fp8

    extension = load_rotary_extension()
    assert extension is not None
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[:-1] + grid[1:]) / 2
    big = torch.tensor(1e9)
    special = torch.cat([grid, mids, torch.nextafter(mids, big), torch.nextafter(mids, -big),
                         torch.tensor([0.0, -0.0, 464.0, -480.0, 1e30, -1e30, 2.0**-10, -(2.0**-10)])])
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 3, 2, 16, 16, 64
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), head_dim, 256)
    kv_size = num_kv_heads * head_dim
    for k_scale, v_scale in ((1.0, 1.0), (0.37, 3.0)):
        values = torch.cat([special, torch.randn(4096, generator=gen) * 40])
        num_tokens = values.numel() // kv_size
        v_rows = values[: num_tokens * kv_size].view(num_tokens, num_kv_heads, head_dim)
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 50
        qkv[:, num_heads * head_dim + kv_size :] = v_rows.reshape(num_tokens, kv_size)
        positions = torch.randint(0, 256, (num_tokens,), generator=gen)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        rotated = rotary.rotate(positions, qkv[:, : num_heads * head_dim + kv_size].view(num_tokens, -1, head_dim))
        want_k = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim, dtype=torch.uint8)
        want_v = torch.zeros_like(want_k)
        want_k.index_copy_(0, slots, quantize_fp8(rotated[:, num_heads:], k_scale).view(torch.uint8))
        want_v.index_copy_(0, slots, quantize_fp8(v_rows, v_scale).view(torch.uint8))
        fused = qkv.clone()
        caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.uint8) for _ in range(2)]
        extension.rotary_kv_write_fp8(fused, positions, rotary.cos_half, rotary.sin_half, caches[0], caches[1], slots,
                                      num_heads, num_kv_heads, k_scale, v_scale)
        assert torch.equal(fused[:, : num_heads * head_dim + kv_size].view(num_tokens, -1, head_dim), rotated)
        assert torch.equal(caches[0].view(-1, num_kv_heads, head_dim), want_k)
        assert torch.equal(caches[1].view(-1, num_kv_heads, head_dim), want_v)


def test_tcmalloc_preload_respects_the_callers_choice() -> None:
    """CPU workers started by `kvflow serve` preload tcmalloc when installed, never over an LD_PRELOAD the caller
    set, and not with KVFLOW_TCMALLOC=0."""
    import ctypes.util

    from engine.process.cpu_memory import tcmalloc_preload

    assert tcmalloc_preload({"LD_PRELOAD": "libjemalloc.so.2"}) is None
    assert tcmalloc_preload({"KVFLOW_TCMALLOC": "0"}) is None
    installed = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    assert tcmalloc_preload({}) == installed


def test_a_dead_builders_lock_file_does_not_hang_the_next_build() -> None:
    # torch waits forever while its `lock` file exists; a build killed mid-way (a stopped CI run) leaves one. The
    # unmarked build takes the builder's path (ninja finds nothing to recompile), which must clear the lock.
    import subprocess
    import sys

    from kernels.cpu_build import BUILT_MARK, QUANT_GEMM, kernel_dir, kernel_loader

    assert kernel_loader(QUANT_GEMM)() is not None
    directory = kernel_dir(QUANT_GEMM)
    stale = directory / "lock"
    (directory / BUILT_MARK).unlink()
    stale.touch()
    try:
        done = subprocess.run([sys.executable, "-m", "kernels.cpu_quant_gemm"], capture_output=True, text=True,
                              timeout=600)
        assert done.stdout.strip() == "built", done.stderr
        assert not stale.exists()
        assert (directory / BUILT_MARK).exists()
    finally:
        stale.unlink(missing_ok=True)
