"""The fused MoE kernel (kernels/fused_moe.py) against its torch reference (a loop over the active experts), at
tiny shapes under Triton's interpreter (re-run in a subprocess with TRITON_INTERPRET=1); the expert alignment
on its own, in plain torch."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

from kernels.fused_moe import MoeTiles, fused_moe, fused_moe_ref, moe_align
from tests.helpers.interpreter import interpreter_cases_test

test_fused_moe_under_interpreter = interpreter_cases_test(__file__, at_least=12, at_most=12, timeout=900)


def _routing(tokens: int, experts: int, top_k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def test_alignment_groups_slots_by_expert_in_padded_tiles() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # 6 slots: expert 0 x2, 1 x1, 2 x3
    sorted_ids, expert_ids, used = moe_align(ids, 4, 4)
    assert sorted_ids.numel() == 20 and expert_ids.numel() == 5  # ceil((6 + 4 * 3) / 4) tiles of 4
    assert int(used) == 12
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]  # expert 3 got no tokens, so no tile
    assert sorted_ids[:12].tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]  # 6 = the padding sentinel (T * k)
    flat = ids.reshape(-1)
    for tile, expert in enumerate(expert_ids.tolist()[:3]):
        slots = [s for s in sorted_ids[tile * 4:(tile + 1) * 4].tolist() if s < 6]
        assert slots and all(int(flat[s]) == expert for s in slots)


def test_alignment_drops_other_ranks_experts() -> None:
    ids = torch.tensor([[0, 3], [2, 1]])  # this rank holds experts 0 and 1 of 4: slots of 2 and 3 are dropped
    sorted_ids, expert_ids, used = moe_align(ids, 2, 2)
    assert int(used) == 4 and expert_ids.tolist()[:2] == [0, 1]
    assert sorted_ids[:4].tolist() == [0, 4, 3, 4] and set(sorted_ids.tolist()) == {0, 3, 4}  # 4: padding


@pytest.mark.triton_interpreter
def test_fused_moe_skips_experts_this_rank_lacks() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=g)
    w13, w2 = torch.randn(3, 48, 32, generator=g) / 6, torch.randn(3, 32, 24, generator=g) / 5
    weights, ids = _routing(9, 6, 2, g)  # 6 experts routed, 3 held here: local ids 0..2 kept, 3..5 dropped
    out = fused_moe(x, w13, w2, weights, ids, MoeTiles(16, 32, 32, group_m=1, num_warps=1, num_stages=1))
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert (ids >= 3).any() and float((out - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (5, 8, 2), (19, 4, 1), (40, 8, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 48, 40  # ragged against every tile: masked K and N edges
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    weights, ids = _routing(tokens, experts, top_k, g)
    tiles = MoeTiles(16, 32, 32, group_m=2, num_warps=1, num_stages=1)
    out = fused_moe(x, w13, w2, weights, ids, tiles)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="w13 must be"):
        fused_moe_ref(x, torch.zeros(4, 6, 8), torch.zeros(4, 8, 4), torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe_ref(x, torch.zeros(4, 6, 8), torch.zeros(4, 8, 3), torch.zeros(2, 2), torch.zeros(3, 2, dtype=torch.long))
