"""Which decoder layers a pipeline-parallel stage holds, and where each rank of a TP x PP world sits.

Layers are split as vLLM splits them (`get_pp_indices`): contiguous runs of num_layers // pp layers, the remainder
given one each to the stages just before the last (the last stage also runs the final norm, the logits head and
the sampler). The first stage embeds the tokens; the last holds the logits head (with tied embeddings, the
embedding matrix as that head).

World ranks: rank 0 is the engine's own process (it schedules and samples), so it sits on the LAST stage; ranks
1..tp-1 are the rest of that stage, then the next tp ranks are the stage before it, and so on. World rank g runs
stage pp-1 - g // tp as tensor-parallel rank g % tp. Every stage has at least one layer.
"""

from __future__ import annotations

from dataclasses import dataclass


def layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers, in stage order (vLLM's partition)."""
    validate_pp(num_layers, pp)
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):  # the remainder goes to the stages before the last
        sizes[-i] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def validate_pp(num_layers: int, pp: int) -> None:
    """Refuse a pipeline size this model cannot be split into (a stage would hold no layer)."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} decoder layers (each stage "
                         "needs at least one)")


@dataclass(frozen=True)
class PipelineStage:
    """One stage's place in the pipeline; `PipelineStage.whole(n)` is the unsplit model."""

    index: int
    size: int
    start: int  # first layer (global index)
    end: int  # one past the last layer

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def holds_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    @staticmethod
    def whole(num_layers: int) -> PipelineStage:
        return PipelineStage(0, 1, 0, num_layers)

    @staticmethod
    def of(num_layers: int, index: int, size: int) -> PipelineStage:
        if not 0 <= index < size:
            raise ValueError(f"stage {index} is outside pipeline_parallel_size {size}")
        start, end = layer_ranges(num_layers, size)[index]
        return PipelineStage(index, size, start, end)


@dataclass(frozen=True)
class WorldRank:
    """World rank `rank` of a tp x pp world (see the module docstring for the order)."""

    rank: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tp * self.pp:
            raise ValueError(f"rank {self.rank} is outside a world of {self.tp} x {self.pp} ranks")

    @property
    def stage(self) -> int:
        return self.pp - 1 - self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def peer(self, stage: int) -> int:
        """The world rank of this rank's tensor-parallel peer on `stage` (whom activations go to or come from)."""
        return (self.pp - 1 - stage) * self.tp + self.tp_rank
