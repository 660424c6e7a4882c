"""Which KV heads move between which ranks of a link between tensor-parallel workers, vLLM NIXL-style: each decode
rank pulls the heads it holds from the prefill rank(s) holding them, over one pair group per (prefill rank, decode
rank) that moves any head. Prefill TP a and decode TP b may differ; one-rank workers are the 1 x 1 case.

Invariants:
- a pair carries distinct heads in ascending order of the model's head ids; a head several prefill ranks hold
  (replicated KV heads, fewer KV heads than ranks) is taken from the lowest of them only;
- pairs exist only where heads move, and both sides build, greet and use them in (prefill rank, decode rank)
  order, so two-sided sends and receives cannot wait on each other in a cycle;
- the message of a pair is the wire layout with the pair's heads (engine/kv_layout.py), the receiver re-assembles
  its local heads (repeats included) from its pairs' messages in pair order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.kv_layout import KVLayout, KVSlice
from protos.kvflow.v1 import kvflow_pb2 as pb

RankHeads = tuple[tuple[int, ...], ...]  # per rank: the model's KV head behind each local head


@dataclass(frozen=True)
class HeadPair:
    src: int  # prefill rank
    dst: int  # decode rank
    heads: tuple[int, ...]  # the model's head ids it carries, ascending


@dataclass(frozen=True)
class HeadPlan:
    src_heads: RankHeads
    dst_heads: RankHeads
    pairs: tuple[HeadPair, ...]  # in (src, dst) order

    def sending(self, rank: int) -> tuple[HeadPair, ...]:
        return tuple(p for p in self.pairs if p.src == rank)

    def receiving(self, rank: int) -> tuple[HeadPair, ...]:
        return tuple(p for p in self.pairs if p.dst == rank)

    def export_heads(self, pair: HeadPair) -> tuple[int, ...] | None:
        """The sender's local head indices of `pair`'s heads; None when that is all its heads in order."""
        local = self.src_heads[pair.src]
        picked = tuple(local.index(h) for h in pair.heads)
        return None if picked == tuple(range(len(local))) else picked

    def assembly(self, rank: int) -> tuple[int, ...] | None:
        """For each local head of decode `rank`, its index among its pairs' heads joined in pair order; None when
        the joined heads are exactly the local ones."""
        joined = [h for p in self.receiving(rank) for h in p.heads]
        picked = tuple(joined.index(h) for h in self.dst_heads[rank])
        return None if picked == tuple(range(len(joined))) else picked

    def pair_bytes(self, layout: KVLayout, pair: HeadPair, part: KVSlice) -> int:
        return replace(layout, num_kv_heads=len(pair.heads)).payload_bytes(part.num_blocks, part.num_layers)

    def total_bytes(self, layout: KVLayout, part: KVSlice) -> int:
        """Every pair's bytes of one slice: what crosses the link for it."""
        return sum(self.pair_bytes(layout, p, part) for p in self.pairs)


def plan_heads(src_heads: RankHeads, dst_heads: RankHeads) -> HeadPlan:
    """Raises ValueError if a decode rank needs a head no prefill rank holds (different models)."""
    owner: dict[int, int] = {}
    for rank, heads in enumerate(src_heads):
        for head in heads:
            owner.setdefault(head, rank)
    pairs = []
    for dst, needed in enumerate(dst_heads):
        missing = sorted(set(needed) - owner.keys())
        if missing:
            raise ValueError(f"decode rank {dst} needs KV heads {missing}, which no prefill rank holds")
    for src in range(len(src_heads)):
        for dst, needed in enumerate(dst_heads):
            heads = tuple(sorted(h for h in set(needed) if owner[h] == src))
            if heads:
                pairs.append(HeadPair(src, dst, heads))
    return HeadPlan(tuple(src_heads), tuple(dst_heads), tuple(pairs))


def assemble(parts: list[torch.Tensor], picked: tuple[int, ...] | None) -> torch.Tensor:
    """Wire tensors [layers, 2, blocks, block, heads, dim] of one rank's pairs -> its local heads' wire tensor."""
    joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=4)
    if picked is None:
        return joined
    return joined.index_select(4, torch.as_tensor(picked, dtype=torch.int64, device=joined.device)).contiguous()


def same_but_heads(a: KVLayout, b: KVLayout) -> bool:
    """Whether two ranks' layouts are of one model and cache config (their KV head counts may differ)."""
    return replace(a, num_kv_heads=0) == replace(b, num_kv_heads=0)


def heads_to_proto(heads: RankHeads) -> list[pb.KVRankHeads]:
    return [pb.KVRankHeads(heads=list(rank)) for rank in heads]


def heads_from_proto(ranks: list[pb.KVRankHeads], layout: KVLayout) -> RankHeads:
    """A peer's ranks; none listed: one rank holding every head of its `layout`."""
    if not ranks:
        return (tuple(range(layout.num_kv_heads)),)
    return tuple(tuple(int(h) for h in rank.heads) for rank in ranks)
