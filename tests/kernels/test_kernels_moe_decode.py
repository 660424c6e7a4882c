"""The MoE decode kernels: one-kernel routing (kernels/moe_route.py) against the torch routing, and the per-slot
expert GEMVs (kernels/moe_gemv.py) against the per-expert loop, at tiny shapes under Triton's interpreter
(re-run in a subprocess with TRITON_INTERPRET=1); the sparse block taking them on its fused path; and the grouped
GEMMs' recorded tile tables (kernels/moe_tiles.py)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

from engine.models.arch import MoEArch
from engine.models.moe import SparseMoeBlock
from kernels.fused_moe import fused_moe_ref
from kernels.moe_gemv import GEMV_MAX_SLOTS, gemv_suits, moe_gemv
from kernels.moe_route import moe_route, moe_route_ref
from kernels.moe_tiles import MoeTiles, load_table, moe_tiles, nearest, select_tiles, table_name
from tests.helpers.interpreter import interpreter_cases_test

test_moe_decode_under_interpreter = interpreter_cases_test(__file__, at_least=18, at_most=18, timeout=600)


def test_gemv_path_is_for_few_slots_over_many_experts() -> None:
    assert gemv_suits(8, 128) and gemv_suits(GEMV_MAX_SLOTS, 128)  # Qwen3-MoE decode: 1-8 tokens at top-8
    assert not gemv_suits(GEMV_MAX_SLOTS + 8, 128)  # a larger batch: the grouped GEMMs
    assert gemv_suits(2, 8) and gemv_suits(4, 8) and not gemv_suits(6, 8)  # Mixtral: tokens would share experts
    assert not gemv_suits(0, 128)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize"),
                         [(1, 8, 2, True), (5, 128, 8, True), (3, 60, 4, False), (2, 6, 6, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_kernel_matches_torch_routing(tokens: int, experts: int, top_k: int, renormalize: bool,
                                            dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(experts + tokens)
    # distinct logits, exact in bf16 (multiples of 1/32 below 4): no ties, whose order torch.topk leaves open
    logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).to(dtype) / 32 - 2
    weights, ids = moe_route(logits, top_k, renormalize, dtype)
    ref_weights, ref_ids = moe_route_ref(logits, top_k, renormalize, dtype)
    assert ids.dtype == torch.int64 and weights.dtype == dtype and weights.shape == (tokens, top_k)
    assert torch.equal(ids, ref_ids)  # the same experts in the same order
    torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(tokens), rtol=2e-2, atol=0.0)


@pytest.mark.triton_interpreter
def test_route_kernel_picks_the_lowest_id_among_equal_logits() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0]])
    _, ids = moe_route(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 2, 4]]


def _experts(num: int, hidden: int, inter: int, dtype: torch.dtype, g: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(num, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return w13, w2


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("tokens", "top_k", "dtype"),
                         [(1, 4, torch.float32), (3, 2, torch.float32), (1, 4, torch.bfloat16), (4, 3, torch.bfloat16)])
def test_gemv_experts_match_the_loop(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7 * tokens + top_k)
    hidden, inter, experts = 40, 24, 8  # ragged against the tiles: masked K and N edges
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w2 = _experts(experts, hidden, inter, dtype, g)
    weights, ids = moe_route_ref(torch.randn(tokens, experts, generator=g), top_k, True, dtype)
    out = moe_gemv(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol


@pytest.mark.triton_interpreter
def test_gemv_experts_of_two_ranks_add_up_to_the_layer() -> None:
    """Expert parallelism: each rank holds half the experts (global ids, shifted by its offset) and adds zero for
    the other half's slots; the two partial sums make the whole layer."""
    g = torch.Generator().manual_seed(11)
    hidden, inter, experts, top_k = 32, 16, 8, 3
    x = torch.randn(2, hidden, generator=g)
    w13, w2 = _experts(experts, hidden, inter, torch.float32, g)
    weights, ids = moe_route_ref(torch.randn(2, experts, generator=g), top_k, True, torch.float32)
    half = experts // 2
    low = moe_gemv(x, w13[:half].contiguous(), w2[:half].contiguous(), weights, ids, 0)
    high = moe_gemv(x, w13[half:].contiguous(), w2[half:].contiguous(), weights, ids, half)
    assert ((ids < half).any() and (ids >= half).any())
    torch.testing.assert_close(low + high, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.triton_interpreter
def test_sparse_block_fused_path_takes_the_decode_kernels() -> None:
    """The engine's block on its fused path (experts stacked) at one bf16 token: router GEMV, routing kernel and
    the expert GEMVs, against the block's own per-expert loop before stacking."""
    torch.manual_seed(5)
    block = SparseMoeBlock(64, MoEArch(16, 4, 32, renormalize=True, sparse_layers=(0,))).to(torch.bfloat16).eval()
    x = torch.randn(1, 64).to(torch.bfloat16)
    with torch.no_grad():
        loop = block(x).float()
        block.stack_experts()
        fused = block(x).float()
    assert float((fused - loop).norm() / loop.norm()) < 2e-2


def test_a_recorded_tile_table_is_read_and_its_nearest_entry_taken(tmp_path) -> None:  # noqa: ANN001
    name = table_name(128, 768, "NVIDIA H200")
    assert name == "E=128,N=768,device_name=NVIDIA_H200.json"
    small, large = MoeTiles(16, 64, 128, 1, 4, 4), MoeTiles(64, 128, 64, 8, 8, 3)
    (tmp_path / name).write_text(json.dumps({"tiles": {"16": asdict(small), "1024": asdict(large)}, "model": "x"}))
    table = load_table(128, 768, "NVIDIA H200", tmp_path)
    assert table == ((16, small), (1024, large))
    assert nearest(table, 1) == small and nearest(table, 520) == small and nearest(table, 600) == large
    assert load_table(64, 768, "NVIDIA H200", tmp_path) == ()  # another shape: no table
    # no GPU here: the heuristic, whatever is recorded
    assert select_tiles(4096, 8, 128, 768, torch.device("cpu")) == moe_tiles(4096 * 8, 128)


def test_the_router_gemv_follows_the_small_gemm_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLOW_SMALL_GEMM=0 (cuBLAS everywhere, the dense layers' A/B switch) keeps the router's logits on its
    nn.Linear too; by default a one-row half-precision step takes the GEMV."""
    import engine.models.moe as moe_module
    from engine.models.layers import SmallGemmMode

    monkeypatch.setattr(moe_module, "uses_small_gemm", lambda x: True)
    calls = []
    monkeypatch.setattr(SmallGemmMode, "linear", lambda self, x, weight, **kw: calls.append(x) or (x @ weight.T,))
    x = torch.randn(1, 64)
    for switch, expected in (("0", 0), ("auto", 1)):
        monkeypatch.setenv("KVFLOW_SMALL_GEMM", switch)
        block = SparseMoeBlock(64, MoEArch(16, 4, 32, renormalize=True, sparse_layers=(0,))).eval()
        with torch.no_grad():
            logits = block._router_logits(x, fused=True)
        torch.testing.assert_close(logits, block.gate(x))
        assert len(calls) == expected
