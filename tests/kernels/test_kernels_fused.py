"""CPU checks of the fused decode kernels (rotary + KV write in one launch; single-pass split-KV decode attention),
through Triton's interpreter, against the unfused torch references.

As in test_kernels.py: TRITON_INTERPRET=1 must be set before ``import triton``, so the checks run in a subprocess
that re-runs this file with it set (tests/helpers/interpreter.py). Inputs are fresh seeded random values; outputs
are NaN-poisoned first.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.paged_decode_attention as dec
import kernels.rotary_kv_write as rkv
from kernels.kv_cache_write import write_kv_cache
from kernels.rotary import build_cos_sin_cache, rotary_embedding
from tests.helpers.interpreter import interpreter_cases_test

interp = pytest.mark.triton_interpreter  # collected only under TRITON_INTERPRET=1 (tests/conftest.py)
# This module's `interp` cases, run in a TRITON_INTERPRET=1 subprocess (tests/helpers/interpreter.py).
test_fused_kernels_under_interpreter = interpreter_cases_test(__file__, at_least=6, at_most=6, timeout=600)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has unwritten (NaN-poisoned) or NaN elements"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_write_kv_matches_the_two_references(dtype: torch.dtype) -> None:
    """q/k/v as views of one fused qkv row (the model's layout), a skipped slot, random positions: the rotated
    q/k and the whole cache are bit-identical to the two unfused Triton kernels the fused one replaces, and
    match the torch references (bf16: within rounding, the interpreter rounds bf16 its own way)."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim, page, blocks = 5, 6, 2, 32, 4, 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.randint(0, 60, (tokens,), generator=g)
    slots = torch.tensor([9, 2, -1, 27, 14])
    cos_sin = build_cos_sin_cache(64, dim)
    caches = [torch.randn(blocks, page, kv_heads, dim, generator=g).to(dtype) for _ in range(2)]
    outs = {}
    def unfused(positions, q, k, v, cos_sin, kc, vc, slots):  # type: ignore[no-untyped-def]
        rotary_embedding(positions, q, k, cos_sin)
        write_kv_cache(k, v, kc, vc, slots)

    for name, fn in (("fused", rkv.rotary_and_write_kv), ("unfused", unfused), ("ref", rkv.rotary_and_write_kv_ref)):
        x = qkv.clone()
        q, k, v = x.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
        kc, vc = (c.clone() for c in caches)
        fn(positions, q, k, v, cos_sin, kc, vc, slots)
        outs[name] = (x, kc, vc)
    for mine, theirs, ref in zip(outs["fused"], outs["unfused"], outs["ref"], strict=True):
        assert torch.equal(mine, theirs)
        assert _rel_err(mine, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert not torch.equal(outs["fused"][1], caches[0])  # something was written


@interp
def test_rotary_and_write_kv_rejects_bad_input() -> None:
    q = torch.zeros(2, 4, 16)
    k = v = torch.zeros(2, 2, 16)
    cache = torch.zeros(3, 4, 2, 16)
    cos_sin = build_cos_sin_cache(8, 16)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="slot_mapping"):
        rkv.rotary_and_write_kv(pos, q, k, v, cos_sin, cache, cache.clone(), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match the cache"):
        rkv.rotary_and_write_kv(pos, q, torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), cos_sin, cache, cache.clone(),
                                pos)


def _paged(lens: list[int], page: int, kv_heads: int, dim: int, g: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    need = [max(1, -(-n // page)) for n in lens]
    perm = torch.randperm(sum(need) + 2, generator=g)
    tables = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n].int()
        used += n
    kc = torch.randn(len(perm), page, kv_heads, dim, generator=g)
    vc = torch.randn(len(perm), page, kv_heads, dim, generator=g)
    return kc, vc, tables


@interp
@pytest.mark.parametrize("splits", [2, 5, 32])
def test_single_pass_decode_matches_reference_and_two_kernel_combine(splits: int) -> None:
    """The last split merges the partials: same function as the reference and the separate combine kernel;
    empty splits (more splits than tiles) and an empty sequence included; the tickets are zero again after."""
    g = torch.Generator().manual_seed(splits)
    lens = [150, 0, 9, 64]
    heads, kv_heads, dim = 6, 2, 32
    kc, vc, tables = _paged(lens, 16, kv_heads, dim, g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tickets = torch.zeros(len(lens) * kv_heads + 3, dtype=torch.int32)
    for _ in range(2):  # a second launch reuses the same tickets
        out = torch.full_like(q, float("nan"))
        dec.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.2, out=out, num_splits=splits, block_n=16,
                                   tickets=tickets, single_pass=True)
        assert torch.equal(tickets, torch.zeros_like(tickets))
    two = dec.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.2, num_splits=splits, block_n=16,
                                     single_pass=False)
    ref = dec.paged_decode_attention_ref(q.double(), kc.double(), vc.double(), tables, seq_lens, 0.2)
    assert _rel_err(out, ref) < 1e-5
    assert _rel_err(out, two) < 1e-6
    assert torch.equal(out[1], torch.zeros_like(out[1]))
