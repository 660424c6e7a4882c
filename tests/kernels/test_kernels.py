"""CPU checks of the Triton kernels in kernels/, run through Triton's interpreter.

Triton only interprets kernels when TRITON_INTERPRET=1 is set before ``import triton`` (its
own library functions such as ``tl.cdiv`` are jit-decorated at import time). Setting it in
this process would leak into every other test module, so when it is not already set, the
kernel tests here are deselected and ``test_kernels_under_interpreter`` re-runs this file in a
subprocess with TRITON_INTERPRET=1 (tests/helpers/interpreter.py), where they run for real.

Every check draws fresh seeded random inputs, poisons outputs with NaN first (so an element
the kernel never wrote fails), and compares with the plain torch reference run in float64
by ||out - ref|| / ||ref|| (METHOD.md thresholds: fp32 far under 1e-3, bf16 under 1e-2).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels._triton as kt
import kernels.kv_cache_write as kvw
import kernels.paged_decode_attention as dec
import kernels.paged_prefill_attention as pre
import kernels.rms_norm as rms
import kernels.rotary as rot
import kernels.silu_and_mul as act
from tests.helpers.interpreter import REPO, interpreter_cases_test

interp = pytest.mark.triton_interpreter  # collected only under TRITON_INTERPRET=1 (tests/conftest.py)

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}

# This module's `interp` cases, run in a TRITON_INTERPRET=1 subprocess (tests/helpers/interpreter.py).
test_kernels_under_interpreter = interpreter_cases_test(__file__, at_least=20, timeout=900)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _nan(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has unwritten (NaN-poisoned) or NaN elements"
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def _paged_cache(
    seq_lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator, spare: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches plus block tables that use shuffled, non-contiguous block ids."""
    need = [max(1, -(-n // page)) for n in seq_lens]
    max_blocks = max(need) + 1  # a wider table than needed: the extra entries must be ignored
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[used : used + k].int()
        tables[b, k:] = perm[-1]  # junk beyond the sequence (a real block id, must not be read)
        used += k
    kc = _randn((num_blocks, page, hkv, d), dtype, g)
    vc = _randn((num_blocks, page, hkv, d), dtype, g)
    return kc, vc, tables


# ---------------------------------------------------------------------------------- decode

DECODE_CASES = [
    # (H, Hkv, D, page, seq_lens, num_splits, dtype)
    (4, 4, 32, 8, [1, 8, 23], 1, torch.float32),  # MHA, one split, page-boundary length
    (8, 2, 32, 16, [37, 5, 64, 100], 1, torch.float32),  # GQA 4
    (14, 2, 64, 8, [70, 3], 3, torch.float32),  # Qwen-like group of 7, split-KV
    (4, 2, 32, 8, [130, 17, 1], 4, torch.float32),  # more splits than tiles for short rows
    (4, 1, 32, 16, [90, 0, 33], 2, torch.float32),  # an empty sequence gives zeros
    (8, 2, 32, 16, [77, 40], 3, torch.bfloat16),
    (4, 2, 32, 8, [50, 9], 1, torch.float16),
    (4, 2, 48, 8, [30, 11], 2, torch.float32),  # head_dim not a power of two (padded to 64)
]


@interp
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_paged_decode_attention(case: int) -> None:
    h, hkv, d, page, lens, splits, dtype = DECODE_CASES[case]
    g = _gen(100 + case)
    kc, vc, bt = _paged_cache(lens, page, hkv, d, dtype, g)
    q = _randn((len(lens), h, d), dtype, g)
    sl = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5
    out = _nan(q.shape, dtype)
    res = dec.paged_decode_attention(q, kc, vc, bt, sl, scale, out=out, num_splits=splits, block_n=16)
    assert res is out
    ref = dec.paged_decode_attention_ref(q.double(), kc.double(), vc.double(), bt, sl, scale)
    assert _rel_err(out, ref) < TOL[dtype]


@interp
def test_paged_decode_splits_agree() -> None:
    """Split-KV must compute the same function as one split (up to fp32 rounding)."""
    g = _gen(7)
    lens = [150, 64, 9]
    kc, vc, bt = _paged_cache(lens, 16, 2, 32, torch.float32, g)
    q = _randn((3, 4, 32), torch.float32, g)
    sl = torch.tensor(lens, dtype=torch.int32)
    one = dec.paged_decode_attention(q, kc, vc, bt, sl, 0.3, num_splits=1, block_n=32)
    many = dec.paged_decode_attention(q, kc, vc, bt, sl, 0.3, num_splits=5, block_n=16)
    assert _rel_err(many, one) < 1e-5


# --------------------------------------------------------------------------------- prefill

PREFILL_CASES = [
    # (H, Hkv, D, page, q_lens, seq_lens, dtype)
    (4, 2, 32, 8, [5, 20, 1, 17], [5, 40, 9, 17], torch.float32),  # prefill, prefix hits, 1-token
    (6, 2, 32, 16, [40, 3], [40, 70], torch.float32),  # several query tiles; long cached prefix
    (4, 4, 32, 8, [33, 16], [33, 48], torch.bfloat16),
    (4, 1, 32, 8, [0, 12, 7], [10, 12, 30], torch.float32),  # a sequence with no new tokens
    (4, 2, 48, 8, [9, 20], [41, 20], torch.float32),  # head_dim 48: padded, masked loads
]


@interp
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_paged_prefill_attention(case: int) -> None:
    h, hkv, d, page, q_lens, lens, dtype = PREFILL_CASES[case]
    g = _gen(200 + case)
    kc, vc, bt = _paged_cache(lens, page, hkv, d, dtype, g)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = _randn((int(cu[-1]), h, d), dtype, g)
    sl = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5
    out = _nan(q.shape, dtype)
    res = pre.paged_prefill_attention(q, kc, vc, bt, cu, sl, scale, out=out, block_m=16, block_n=16)
    assert res is out
    ref = pre.paged_prefill_attention_ref(q.double(), kc.double(), vc.double(), bt, cu, sl, scale)
    assert _rel_err(out, ref) < TOL[dtype]


@interp
def test_prefill_one_token_matches_decode() -> None:
    g = _gen(8)
    lens = [45, 12]
    kc, vc, bt = _paged_cache(lens, 8, 2, 32, torch.float32, g)
    q = _randn((2, 4, 32), torch.float32, g)
    sl = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    a = pre.paged_prefill_attention(q, kc, vc, bt, cu, sl, 0.2, block_m=16, block_n=16)
    b = dec.paged_decode_attention(q, kc, vc, bt, sl, 0.2, num_splits=2, block_n=16)
    assert _rel_err(a, b) < 1e-5


# ------------------------------------------------------------------------------- KV write


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache(dtype: torch.dtype) -> None:
    g = _gen(300)
    t, hkv, d, page, nb = 37, 2, 32, 8, 8  # 37 tokens: several programs, a ragged last one
    # key/value as views into a fused qkv buffer (row stride wider than Hkv*D)
    qkv = _randn((t, (4 + 2 * hkv) * d), dtype, g)
    key = qkv[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)
    value = qkv[:, (4 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(nb * page, generator=g)[:t].long()
    slots[[2, 7, 36]] = -1  # padding tokens: skipped
    kc, vc = _nan((nb, page, hkv, d), dtype), _nan((nb, page, hkv, d), dtype)
    kr, vr = kc.clone(), vc.clone()
    kvw.write_kv_cache(key, value, kc, vc, slots)
    kvw.write_kv_cache_ref(key, value, kr, vr, slots)
    assert torch.equal(kc.isnan(), kr.isnan()), "written / untouched slots differ from the reference"
    assert torch.equal(kc.nan_to_num(), kr.nan_to_num()) and torch.equal(vc.nan_to_num(), vr.nan_to_num())
    written = slots[slots >= 0]
    assert not kc.view(-1, hkv, d)[written].isnan().any()


@interp
def test_write_then_attend_round_trip() -> None:
    """The write kernel and the prefill kernel agree on the cache layout."""
    g = _gen(301)
    h, hkv, d, page, n = 4, 2, 32, 8, 19
    bt = torch.tensor([[5, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(bt[0, i // page]) * page + i % page for i in range(n)], dtype=torch.int64)
    k, v, q = _randn((n, hkv, d), torch.float32, g), _randn((n, hkv, d), torch.float32, g), _randn(
        (n, h, d), torch.float32, g
    )
    kc, vc = _randn((6, page, hkv, d), torch.float32, g), _randn((6, page, hkv, d), torch.float32, g)
    kvw.write_kv_cache(k, v, kc, vc, slots)
    cu, sl = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    out = pre.paged_prefill_attention(q, kc, vc, bt, cu, sl, 0.25, block_m=16, block_n=16)
    # dense causal attention on the unpaged k/v
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * 0.25
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    assert _rel_err(out, ref) < 1e-5


# -------------------------------------------------------------------------------- RMSNorm


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype: torch.dtype) -> None:
    g = _gen(400)
    x, w = _randn((5, 200), dtype, g), _randn((200,), dtype, g)
    out = _nan(x.shape, dtype)
    rms.rms_norm(x, w, 1e-6, out=out)
    assert _rel_err(out, rms.rms_norm_ref(x.double(), w.double(), 1e-6)) < TOL[dtype]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    g = _gen(401)
    x, r, w = _randn((4, 300), dtype, g), _randn((4, 300), dtype, g), _randn((300,), dtype, g)
    xr, rr = x.double(), r.double()
    rms.fused_add_rms_norm_ref(xr, rr, w.double(), 1e-5)
    x_out, r_out = rms.fused_add_rms_norm(x, r, w, 1e-5)
    assert x_out is x and r_out is r
    assert _rel_err(r, rr) < TOL[dtype]
    assert _rel_err(x, xr) < TOL[dtype]


# --------------------------------------------------------------------------------- rotary


@interp
@pytest.mark.parametrize("layout", ["2d_fused_view", "3d", "no_key"])
def test_rotary_embedding(layout: str) -> None:
    g = _gen(500)
    t, h, hkv, d = 6, 4, 2, 32
    cache = rot.build_cos_sin_cache(64, d, base=10000.0)
    pos = torch.randint(0, 64, (t,), generator=g, dtype=torch.int64)
    if layout == "2d_fused_view":
        qkv = _randn((t, (h + 2 * hkv) * d), torch.float32, g)
        q, k = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d]
    else:
        q, k = _randn((t, h, d), torch.float32, g), _randn((t, hkv, d), torch.float32, g)
        if layout == "no_key":
            k = None
    qr = q.double().clone()
    kr = k.double().clone() if k is not None else None
    rot.rotary_embedding_ref(pos, qr, kr, cache.double())
    rot.rotary_embedding(pos, q, k, cache)
    assert _rel_err(q, qr) < 1e-5
    if k is not None:
        assert _rel_err(k, kr) < 1e-5


def test_rotary_matches_hf_rotate_half() -> None:
    """Cross-check the reference itself against HF's rotate_half formulation."""
    g = _gen(501)
    t, h, d = 5, 2, 16
    pos = torch.arange(t, dtype=torch.int64) * 3
    x = _randn((t, h, d), torch.float64, g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([torch.outer(pos.double(), inv)] * 2, dim=-1)[:, None, :]
    rotate_half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    hf = x * emb.cos() + rotate_half * emb.sin()
    ours = x.clone()
    rot.rotary_embedding_ref(pos, ours, None, rot.build_cos_sin_cache(16, d, dtype=torch.float64))
    assert _rel_err(ours, hf) < 1e-12


# ------------------------------------------------------------------------------- SiLU-mul


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    g = _gen(600)
    x = _randn((3, 2 * 1500), dtype, g)  # 1500 > one 1024-column block: exercises the 2D grid
    out = _nan((3, 1500), dtype)
    act.silu_and_mul(x, out=out)
    assert _rel_err(out, act.silu_and_mul_ref(x.double())) < TOL[dtype]


# ------------------------------------------------------------------------ contract & errors


def test_input_validation() -> None:
    g = _gen(700)
    kc, vc, bt = _paged_cache([10], 8, 2, 32, torch.float32, g)
    q = _randn((1, 4, 32), torch.float32, g)
    sl = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables"):
        dec.paged_decode_attention(q, kc, vc, bt.long(), sl, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        dec.paged_decode_attention(_randn((1, 3, 32), torch.float32, g), kc, vc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        bad = _randn((4, 6, 2, 32), torch.float32, g)
        dec.paged_decode_attention(q, bad, bad.clone(), bt, sl, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pre.paged_prefill_attention(q[0:1].reshape(1, 4, 32), kc, vc, bt, torch.tensor([0, 1]), sl, 0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        kvw.write_kv_cache(q[:, :2], q[:, :2], kc, vc, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="positions"):
        rot.rotary_embedding(torch.tensor([0], dtype=torch.int32), q, None, rot.build_cos_sin_cache(8, 32))


def test_launcher_without_triton_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kt, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="needs Triton"):
        rms.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)


def test_modules_import_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import kernels._triton as kt\n"
        "assert not kt.HAS_TRITON\n"
        "import kernels.paged_decode_attention, kernels.paged_prefill_attention, kernels.kv_cache_write\n"
        "import kernels.rms_norm as r, kernels.rotary, kernels.silu_and_mul, torch\n"
        "x = torch.randn(2, 8)\n"
        "torch.testing.assert_close(r.rms_norm_ref(x, torch.ones(8), 1e-6), "
        "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n"
        "try:\n    r.rms_norm(x, torch.ones(8), 1e-6)\nexcept RuntimeError:\n    pass\n"
        "else:\n    raise SystemExit('no RuntimeError')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
