"""The fused MoE kernel (kernels/fused_moe.py) against its torch reference (a loop over the active experts), at
tiny shapes under Triton's interpreter (re-run in a subprocess with TRITON_INTERPRET=1); the expert alignment
on its own (plain torch outside the interpreter, the Triton kernel inside it), and the Triton alignment against
the torch one bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.fused_moe as fm
from kernels.fused_moe import MoeTiles, fused_moe, fused_moe_ref, moe_align, moe_align_ref, moe_align_triton
from tests.helpers.interpreter import interpreter_cases_test

test_fused_moe_under_interpreter = interpreter_cases_test(__file__, at_least=26, at_most=26, timeout=900)


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


def _align_ids(tokens: int, top_k: int, experts: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """Routing ids of one shape: `random` (uniform over the experts), `ragged` (a few experts take most slots),
    `one_expert` (every slot on one expert), `ep_drop` (ids in [-1, 2E): other ranks' experts and -1 dropped)."""
    if kind == "random":
        return torch.randint(0, experts, (tokens, top_k), generator=g)
    if kind == "ragged":
        skew = torch.rand(experts, generator=g) ** 6 + 1e-3
        return torch.multinomial(skew, tokens * top_k, replacement=True, generator=g).view(tokens, top_k)
    if kind == "one_expert":
        return torch.full((tokens, top_k), experts // 2 + 1)
    return torch.randint(-1, 2 * experts, (tokens, top_k), generator=g)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m", "kind"), [
    (1, 1, 8, 16, "random"),  # T*k = 1
    (1, 1, 8, 16, "ep_drop_all"),  # the one slot dropped: nothing used, every tile -1
    (1, 8, 128, 16, "random"),  # Qwen3-30B-A3B decode batch 1 (128 experts, top-8)
    (3, 2, 8, 32, "ragged"),
    (37, 4, 8, 16, "ragged"),
    (64, 8, 128, 64, "ragged"),
    (16, 8, 128, 32, "one_expert"),
    (50, 3, 8, 64, "one_expert"),
    (33, 8, 128, 16, "ep_drop"),
    (20, 2, 8, 32, "ep_drop"),
    (10, 6, 60, 16, "ep_drop"),  # E not a power of two: ids 60..63 fall inside the kernel's 64 columns
    (300, 8, 128, 16, "random"),  # 2400 slots: many chunks, running per-expert cursors across them
    (9, 1, 256, 16, "random"),
])
def test_triton_alignment_matches_torch_bit_for_bit(tokens: int, top_k: int, experts: int, block_m: int,
                                                    kind: str) -> None:
    g = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + block_m)
    if kind == "ep_drop_all":
        ids = torch.full((tokens, top_k), experts)
    else:
        ids = _align_ids(tokens, top_k, experts, kind, g)
    for dtype in (torch.int64, torch.int32):  # topk's int64, and the int32 some routers emit
        got = moe_align_triton(ids.to(dtype), block_m, experts)
        ref = moe_align_ref(ids.to(dtype), block_m, experts)
        for a, b in zip(got, ref, strict=True):
            assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape and torch.equal(a, b), (a, b)
    if kind == "ep_drop_all":
        assert int(got[2]) == 0 and (got[1] == -1).all() and (got[0] == tokens * top_k).all()


@pytest.mark.triton_interpreter
def test_alignment_dispatches_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(fm, "MOE_ALIGN_TRITON_MAX_SLOTS", 8)
    monkeypatch.setattr(fm, "moe_align_triton", lambda *a: calls.append("triton") or moe_align_triton(*a))
    monkeypatch.setattr(fm, "moe_align_ref", lambda *a: calls.append("torch") or moe_align_ref(*a))
    small, large = torch.zeros(4, 2, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)
    assert torch.equal(fm.moe_align(small, 16, 4)[0], moe_align_ref(small, 16, 4)[0])
    assert torch.equal(fm.moe_align(large, 16, 4)[0], moe_align_ref(large, 16, 4)[0])
    assert calls == ["triton", "torch"]


@pytest.mark.outside_interpreter
def test_alignment_on_cpu_without_interpreter_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the Triton alignment ran on CPU outside the interpreter")

    monkeypatch.setattr(fm, "moe_align_triton", refuse)
    ids = torch.tensor([[1, 0]])
    assert torch.equal(fm.moe_align(ids, 4, 2)[0], moe_align_ref(ids, 4, 2)[0])


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
