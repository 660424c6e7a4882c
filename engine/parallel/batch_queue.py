"""Pipeline micro-batches: up to one scheduled batch in flight per stage, as vLLM's virtual engines / batch queue.

With P stages, a single batch would leave P-1 stages idle at any moment. Each engine step here first fills the
queue: while fewer than P batches are in flight, it schedules another from the requests no batch in flight holds
(`Scheduler.schedule(in_flight=...)`) and submits it (every rank gets it at once, so stage 0 starts on it while the
later stages still work on the batches before it). Then it collects the oldest batch (rank 0 runs the last stage
on it and samples) and returns it for the scheduler's update. Each batch takes an even share of the schedulable
requests over the free slots, so the stages get batches of similar size rather than one batch of everything.

Invariants:
- Batches are submitted and collected in the same order (every rank runs them in that order: KV writes, swaps and
  dropped request state apply in the order they were scheduled).
- A request is in at most one batch in flight, and no batch in flight loses its blocks (never preempted).
- A schedule with nothing to compute ends the fill; it is still submitted when it tells the ranks something
  (finished ids, swaps, host-tier copies) or when nothing else is in flight (the step then returns it, as a step without pipelining
  would).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput, SchedulerOutput


class PipelinedRunner(Protocol):
    """What the queue needs from rank 0's runner (engine/parallel/executor.py)."""

    def submit(self, so: SchedulerOutput) -> None: ...

    def collect(self, so: SchedulerOutput) -> ModelRunnerOutput: ...


class BatchQueue:
    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a batch queue needs a depth >= 2 (one batch per pipeline stage), got {depth}")
        self.depth = depth
        self.in_flight: deque[SchedulerOutput] = deque()
        self.most_in_flight = 0  # the largest number of non-empty batches in flight at once (observability)

    @property
    def busy(self) -> bool:
        """Batches are in flight: the engine must keep stepping until they are back, even if every request in them
        was aborted meanwhile (a stage would otherwise wait in its send until the group's timeout)."""
        return bool(self.in_flight)

    def step(self, scheduler: Scheduler, runner: PipelinedRunner) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Fill the pipeline, then collect its oldest batch."""
        self._fill(scheduler, runner)
        so = self.in_flight.popleft()
        return so, runner.collect(so)

    def _fill(self, scheduler: Scheduler, runner: PipelinedRunner) -> None:
        while len(self.in_flight) < self.depth:
            busy = self._request_ids()
            schedulable = sum(1 for r in scheduler.running if r.request_id not in busy) + len(scheduler.waiting)
            share = max(1, math.ceil(schedulable / (self.depth - len(self.in_flight))))
            so = scheduler.schedule(in_flight=busy, max_seqs=share)
            if self.in_flight and _carries_nothing(so):
                break  # nothing to compute and nothing to tell the ranks: wait for the batches in flight
            runner.submit(so)
            self.in_flight.append(so)
            if not so.chunks:
                break
            self.most_in_flight = max(self.most_in_flight, sum(1 for b in self.in_flight if b.chunks))

    def _request_ids(self) -> frozenset[str]:
        return frozenset(chunk.request_id for so in self.in_flight for chunk in so.chunks)


def _carries_nothing(so: SchedulerOutput) -> bool:
    return not (so.chunks or so.finished_request_ids or so.blocks_to_swap_in or so.blocks_to_swap_out
                or so.kv_tier_copies or so.new_requests)
