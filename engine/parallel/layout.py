"""Which slice of each weight a tensor-parallel rank holds.

Heads. With at least as many KV heads as ranks, whole GQA groups are dealt out: the KV heads are split in
contiguous, near-even runs and each rank takes the query heads that read them. Every rank then keeps the model's
group size, and uneven counts are fine (SmolLM2's 3 KV heads at TP=2: rank 0 holds KV heads 0-1 with query heads
0-5, rank 1 KV head 2 with query heads 6-8). With fewer KV heads than ranks, the query heads are split near-evenly
and each rank holds (replicates) the KV heads its query heads read; if a rank's query heads would then read its KV
heads unevenly, it keeps one KV head per query head, so local attention stays a plain uniform-group GQA.

MLP intermediate and vocabulary rows are split in contiguous near-even runs (the vocabulary in equal padded runs
so an all-gather can join the logits; the last rank's run may be shorter).

Experts (MoE models): with expert parallelism each rank holds a contiguous near-even run of whole experts;
without it every rank holds every expert, each sliced like a dense MLP (a contiguous run of its intermediate rows).
A shared expert (Qwen2-MoE) is sliced like a dense MLP either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.arch import ModelArch


def _runs(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous runs covering range(total), sizes differing by at most one."""
    base, extra = divmod(total, parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        runs.append((start, end))
        start = end
    return runs


@dataclass(frozen=True)
class RankShard:
    """One rank's slice of the model; `RankShard.full(arch)` is the unsharded model."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # [start, end) of the global query heads
    kv_heads: tuple[int, ...]  # the global KV head behind each local KV head (may repeat, may be shared)
    intermediate: tuple[int, int]  # [start, end) of the MLP intermediate rows
    vocab: tuple[int, int]  # [start, end) of the vocabulary rows
    vocab_padded: int  # every rank's run length when gathering logits (>= the local run)
    experts: tuple[int, int] = (0, 0)  # [start, end) of the experts this rank holds (MoE models)
    expert_intermediate: tuple[int, int] = (0, 0)  # [start, end) of each held expert's intermediate rows
    shared_expert_intermediate: tuple[int, int] = (0, 0)  # [start, end) of the shared expert's intermediate rows

    @property
    def expert_intermediate_size(self) -> int:
        return self.expert_intermediate[1] - self.expert_intermediate[0]

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.shared_expert_intermediate[1] - self.shared_expert_intermediate[0]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    @staticmethod
    def full(arch: ModelArch) -> RankShard:
        return shard_for(arch, 0, 1)


def validate_tp(arch: ModelArch, size: int) -> None:
    """Refuse a TP size this model cannot be split into (a rank would hold no query head)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size > arch.num_heads:
        raise ValueError(f"tensor_parallel_size={size} exceeds the model's {arch.num_heads} attention heads")
    if size > arch.intermediate_size or size > arch.vocab_size:
        raise ValueError(f"tensor_parallel_size={size} is too large for this model")


def shard_for(arch: ModelArch, rank: int, size: int, expert_parallel: bool = False) -> RankShard:
    validate_tp(arch, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside tensor_parallel_size {size}")
    group = arch.num_heads // arch.num_kv_heads
    if arch.num_kv_heads >= size:
        kv_start, kv_end = _runs(arch.num_kv_heads, size)[rank]
        q_heads = (kv_start * group, kv_end * group)
        kv_heads = tuple(range(kv_start, kv_end))
    else:
        q_heads = _runs(arch.num_heads, size)[rank]
        kv_of = [h // group for h in range(*q_heads)]
        distinct = sorted(set(kv_of))
        counts = {kv_of.count(k) for k in distinct}
        kv_heads = tuple(distinct) if len(counts) == 1 else tuple(kv_of)
    padded = -(-arch.vocab_size // size)
    vocab = (min(rank * padded, arch.vocab_size), min((rank + 1) * padded, arch.vocab_size))
    if vocab[1] <= vocab[0]:
        raise ValueError(f"tensor_parallel_size={size} leaves rank {rank} no vocabulary rows")
    num_experts, expert_rows = (arch.moe.num_experts, arch.moe.expert_intermediate_size) if arch.moe else (0, 0)
    shared_rows = arch.moe.shared_expert_intermediate_size if arch.moe else 0
    if expert_parallel:
        experts, expert_intermediate = _runs(num_experts, size)[rank], (0, expert_rows)
    else:
        experts, expert_intermediate = (0, num_experts), _runs(expert_rows, size)[rank]
    return RankShard(rank, size, q_heads, kv_heads, _runs(arch.intermediate_size, size)[rank], vocab, padded,
                     experts, expert_intermediate, _runs(shared_rows, size)[rank])
