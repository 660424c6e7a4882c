"""The process groups of a TP x PP world, and how a pipeline stage passes activations on.

`ParallelWorld` is what every rank joins (engine/parallel/executor.py starts them): one group over all ranks (the
KV block-count agreement and the stages' point-to-point sends) and, with pipeline stages of more than one rank,
each stage's own tensor-parallel group on the same store. With one stage the world group IS the tensor-parallel
group, as before pipeline parallelism existed. NCCL between GPUs, gloo on CPUs, behind the same `TPGroup` calls.

`StageLink` is a stage's forward: receive the previous stage's [2, T, H] (hidden states, residual) from this
rank's peer there, run this stage's layers, send the result to the peer on the next stage. Every rank of every
stage runs every step (rank 0, on the last stage, writes the step to all of them first), so each receive is
matched by exactly one send of the same shape: T is the step's token count, known to all from the step itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.kv_layout import DTYPES
from engine.parallel.group import TPGroup
from engine.parallel.stages import PipelineStage, WorldRank

if TYPE_CHECKING:
    from engine.outputs import SchedulerOutput


class StageLink:
    """One rank's place in the pipeline and its activations in and out."""

    def __init__(self, world: TPGroup, place: WorldRank, stage: PipelineStage, hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.world, self.place, self.stage = world, place, stage
        self.hidden_size, self.dtype = hidden_size, dtype

    def forward(self, run: Callable[[torch.Tensor | None], torch.Tensor], num_tokens: int,
                device: torch.device) -> torch.Tensor:
        """`run(intermediate)` is this stage's model forward; its output goes on to the next stage unless this
        stage is the last (then it is the final hidden states, for the logits)."""
        intermediate = None
        if not self.stage.is_first:
            buffer = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=device)
            intermediate = self.world.recv(buffer, self.place.peer(self.stage.index - 1))
        out = run(intermediate)
        if not self.stage.is_last:
            self.world.send(out.contiguous(), self.place.peer(self.stage.index + 1))
        return out


class ParallelWorld:
    """Every rank of the world; world rank 0 hosts the store (see engine/parallel/stages.py for the rank order)."""

    def __init__(self, host: str, port: int, rank: int, config: EngineConfig, device: torch.device,
                 timeout_s: float) -> None:
        tp, pp = config.device.tensor_parallel_size, config.device.pipeline_parallel_size
        self.group = TPGroup(host, port, rank, tp * pp, device, timeout_s)
        self.backend = self.group.backend
        self.tp: TPGroup | None = self.group if pp == 1 else None
        self.link: StageLink | None = None
        place = WorldRank(rank, tp, pp)
        self.where = f"rank {rank} (tensor rank {place.tp_rank} of {tp}" + \
            (f", stage {place.stage} of {pp})" if pp > 1 else ")")
        if pp == 1:
            self._enable_peer_all_reduce(config)
            return
        arch = config.model.arch
        try:
            if tp > 1:  # each stage's own group, keyed by stage on the world's store
                self.tp = TPGroup(host, port, place.tp_rank, tp, device, timeout_s, store=self.group.store,
                                  prefix=f"kvflow-tp-stage{place.stage}")
        except BaseException:
            self.group.close(failed=True)
            raise
        self._enable_peer_all_reduce(config)
        stage = PipelineStage.of(arch.num_layers, place.stage, pp)
        self.link = StageLink(self.group, place, stage, arch.hidden_size, DTYPES[config.model.dtype])

    def _enable_peer_all_reduce(self, config: EngineConfig) -> None:
        """The tensor-parallel group's small all-reduces over peer GPU memory, where the operator asked for it
        (--enable-custom-all-reduce); on failure the group is closed, as for any other start-up error."""
        if self.tp is None or self.tp.size == 1 or not config.device.custom_all_reduce:
            return
        try:
            self.tp.enable_peer_all_reduce()
        except BaseException:
            self.close(failed=True)
            raise

    def calls_since(self) -> Callable[[], str]:
        """A snapshot of the calls issued so far; calling the result says what was issued since (hang reports)."""
        groups = [("world", self.group)] + ([("stage tp", self.tp)] if self.tp is not None and
                                            self.tp is not self.group else [])
        before = [(name, group, group.calls.snapshot()) for name, group in groups]
        return lambda: "calls issued since: " + "; ".join(f"{name} group: {group.calls.since(snap)}"
                                                         for name, group, snap in before)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the KV block count every stage can hold)."""
        return self.group.min_int(value)

    def close(self, failed: bool = False) -> None:
        if self.tp is not None and self.tp is not self.group:
            self.tp.close(failed)
        self.group.close(failed)


def describe_step(index: int, so: SchedulerOutput) -> str:
    """One step as a hang report names it: its index on this rank and its size."""
    return (f"step {index} ({len(so.chunks)} chunks, {so.total_num_scheduled_tokens} tokens, "
            f"{len(so.new_requests)} new requests)")
