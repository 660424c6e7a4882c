"""fp8 (e4m3) KV cache in the Triton kernels (KV write, fused rotary + KV write, paged decode and prefill
attention) against the torch fp8 reference, at tiny shapes under Triton's interpreter (re-run in a subprocess
with TRITON_INTERPRET=1, as tests/kernels/test_kernels.py does)."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.kv_cache_write as kvw
import kernels.paged_decode_attention as dec
import kernels.paged_prefill_attention as pre
import kernels.rotary as rot
import kernels.rotary_kv_write as rkv
from kernels.fp8_kv import FP8_DTYPE, quantize_fp8
from tests.helpers.interpreter import interpreter_cases_test

interp = pytest.mark.triton_interpreter
FP8 = FP8_DTYPE
# This module's `interp` cases, run in a TRITON_INTERPRET=1 subprocess (tests/helpers/interpreter.py).
test_fp8_kernels_under_interpreter = interpreter_cases_test(__file__, at_least=6, timeout=900)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_cache(shape: tuple[int, ...], g: torch.Generator, scale: float) -> torch.Tensor:
    return quantize_fp8(torch.randn(shape, generator=g) * 3, scale)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@interp
@pytest.mark.parametrize("dtype,k_scale,v_scale", [(torch.float32, 1.0, 1.0), (torch.bfloat16, 0.05, 2.0)])
def test_write_kv_cache_fp8_bit_exact(dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    t, hkv, d, page, nb = 37, 2, 32, 8, 8
    key = (torch.randn(t, hkv, d, generator=g) * 8).to(dtype)
    value = (torch.randn(t, hkv, d, generator=g) * 8).to(dtype)
    key[0, 0, :4] = torch.tensor([7.93, 1000.0, -1e-4, 0.0078]).to(dtype)  # exponent carry, saturation, tiny
    slots = torch.randperm(nb * page, generator=g)[:t].long()
    slots[[3, 20]] = -1
    kc, vc = torch.zeros(nb, page, hkv, d, dtype=FP8), torch.zeros(nb, page, hkv, d, dtype=FP8)
    kr, vr = kc.clone(), vc.clone()
    kvw.write_kv_cache(key, value, kc, vc, slots, k_scale, v_scale)
    kvw.write_kv_cache_ref(key, value, kr, vr, slots, k_scale, v_scale)
    assert torch.equal(_bits(kc), _bits(kr)) and torch.equal(_bits(vc), _bits(vr))


@interp
def test_rotary_write_kv_fp8_bit_exact() -> None:
    g = torch.Generator().manual_seed(2)
    t, h, hkv, d, page, nb = 9, 4, 2, 32, 8, 4
    cache = rot.build_cos_sin_cache(64, d, base=10000.0)
    pos = torch.randint(0, 64, (t,), generator=g)
    q, k, v = (torch.randn(t, n, d, generator=g) * 4 for n in (h, hkv, hkv))
    slots = torch.randperm(nb * page, generator=g)[:t].long()
    kc, vc = torch.zeros(nb, page, hkv, d, dtype=FP8), torch.zeros(nb, page, hkv, d, dtype=FP8)
    kr, vr = kc.clone(), vc.clone()
    qr, kr_in = q.clone(), k.clone()
    rkv.rotary_and_write_kv(pos, q, k, v, cache, kc, vc, slots, 0.5, 0.25)
    rkv.rotary_and_write_kv_ref(pos, qr, kr_in, v.clone(), cache, kr, vr, slots, 0.5, 0.25)
    assert torch.allclose(q, qr, atol=1e-5)
    # rotated k may differ from the reference in its last fp32 bit, which can move an fp8 rounding by one step
    differ = (_bits(kc) != _bits(kr)).float().mean().item()
    assert differ < 0.01 and torch.equal(_bits(vc), _bits(vr))


def _paged(lens: list[int], page: int, hkv: int, d: int, g: torch.Generator, k_scale: float, v_scale: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    need = [max(1, -(-n // page)) for n in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[used: used + k].int()
        used += k
    return (_fp8_cache((num_blocks, page, hkv, d), g, k_scale), _fp8_cache((num_blocks, page, hkv, d), g, v_scale),
            tables)


@interp
# float16 queries take the widen-to-float16 products (a bfloat16 query does too on a GPU; the interpreter upcasts it)
@pytest.mark.parametrize("dtype,splits", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 2),
                                          (torch.float16, 2)])
def test_decode_attention_fp8(dtype: torch.dtype, splits: int) -> None:
    g = torch.Generator().manual_seed(3)
    h, hkv, d, page, lens = 8, 2, 32, 8, [37, 5, 64]
    ks, vs = 0.1, 0.02
    kc, vc, bt = _paged(lens, page, hkv, d, g, ks, vs)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    out = dec.paged_decode_attention(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, block_n=16, single_pass=False,
                                     k_scale=ks, v_scale=vs)
    ref = dec.paged_decode_attention_ref(q.double(), kc, vc, bt, sl, d**-0.5, ks, vs)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_fp8(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    h, hkv, d, page, lens = 4, 2, 32, 8, [21, 19]  # 5 and 19 new tokens (cu below)
    ks, vs = 0.1, 0.02
    kc, vc, bt = _paged(lens, page, hkv, d, g, ks, vs)
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    q = torch.randn(24, h, d, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    out = pre.paged_prefill_attention(q, kc, vc, bt, cu, sl, d**-0.5, block_m=16, block_n=16, k_scale=ks,
                                      v_scale=vs)
    ref = pre.paged_prefill_attention_ref(q.double(), kc, vc, bt, cu, sl, d**-0.5, ks, vs)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@interp
@pytest.mark.parametrize("dtype,m,k,max_block", [(torch.float32, 5, 96, 4096), (torch.bfloat16, 3, 200, 64)])
def test_per_token_quant_fp8_bit_exact(dtype: torch.dtype, m: int, k: int, max_block: int) -> None:
    """One launch (one pass, or two over K in tiles), bit for bit the torch reference: subnormal codes, an
    all-zero row (the minimum scale) and ties included."""
    from engine.quant.fp8_linear import quantize_per_token
    from kernels.fp8_quant import per_token_quant_fp8

    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 1, k)[None, :]  # many codes in e4m3's subnormals
    x[1] = 0.0
    x[0, :4] = torch.tensor([448.0, -0.875 * 448 / 64, 0.9375 * 448 / 16, 3.0])  # exact, near-tie and a tie
    x = x.to(dtype)
    q, scale = per_token_quant_fp8(x, max_block=max_block)
    ref_q, ref_scale = quantize_per_token(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(_bits(q), _bits(ref_q))
    assert (_bits(ref_q) & 0x78 == 0).sum() > 0  # the case holds subnormal codes


@interp
def test_triton_backend_takes_each_layers_kv_scales() -> None:
    """The engine's Triton backend hands a call's (k_scale, v_scale) to the KV write and both attention kernels: with
    K/V far beyond 448 and scales of 20 it stores and attends as the torch backend does, bit for bit in the cache,
    and scale 1.0 (clipping) gives another answer."""
    from engine.runner.attention import AttentionBatch, TorchPagedAttention
    from engine.runner.attention_triton import TritonPagedAttention

    g = torch.Generator().manual_seed(0)
    page, hkv, h, d, scales = 16, 2, 4, 32, (20.0, 20.0)
    batch = AttentionBatch(query_lens=[1, 5], seq_lens=[20, 5], block_tables=[[0, 1], [2]],
                           slot_mapping=[19, 32, 33, 34, 35, 36])  # one decode row after 19 cached tokens, one prompt
    q = torch.randn(6, h, d, generator=g)
    k, v = torch.randn(6, hkv, d, generator=g) * 3000, torch.randn(6, hkv, d, generator=g) * 3000
    earlier = quantize_fp8(torch.randn(19, hkv, d, generator=g) * 3000, 20.0)

    def run(backend: object, *kv_scales: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        caches = [torch.zeros(8, page, hkv, d, dtype=FP8) for _ in range(2)]
        for cache in caches:
            _bits(cache).view(-1, hkv, d)[:19] = _bits(earlier)
        meta = backend.build_metadata(batch, torch.device("cpu"))  # type: ignore[attr-defined]
        out = backend.forward(q.clone(), k.clone(), v.clone(), tuple(caches), meta, d**-0.5,  # type: ignore[attr-defined]
                              *([kv_scales] if kv_scales else []))
        return out, _bits(caches[0]).clone(), _bits(caches[1]).clone()

    ref, ref_k, ref_v = run(TorchPagedAttention(page), *scales)
    out, got_k, got_v = run(TritonPagedAttention(page), *scales)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    assert _rel(out, ref) < 1e-5
    clipped, _, _ = run(TritonPagedAttention(page))  # the default 1.0: every |value| over 448 clips
    assert _rel(clipped, ref) > 0.1
