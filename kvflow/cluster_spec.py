"""`ClusterSpec`: what a one-machine cluster starts (how many workers of each role, their engine arguments, GPUs,
tensor-parallel sizes, credentials and extra flags). kvflow/launcher.py starts it; kvflow/placement.py places it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from cluster.auth import ClusterAuth
from engine.arg_utils import EngineArgs


@dataclass(frozen=True)
class ClusterSpec:
    engine_args: EngineArgs
    prefill_workers: int = 1
    decode_workers: int = 1
    index: str = "memory"
    host: str = "127.0.0.1"
    disagg_min_prompt_tokens: int | None = None
    log_dir: Path | None = None
    worker_extra_args: tuple[str, ...] = ()
    decode_extra_args: tuple[str, ...] = ()  # e.g. a smaller KV pool on decode workers
    prefill_gpus: tuple[int, ...] | None = None  # GPU index per prefill worker (None: spread over the visible)
    decode_gpus: tuple[int, ...] | None = None
    kv_transfer_backend: str = "auto"
    # None: each worker's share is 0.9 / (workers on its GPU); a number is every worker's own share (vLLM's rule)
    gpu_memory_utilization: float | None = None
    auth: ClusterAuth = ClusterAuth()  # what the workers demand (and the launcher's own probe presents)
    drain_timeout_s: float | None = None  # the workers' --drain-timeout (None: theirs)
    # Workers run `kvflow worker` (both roles; the router moves them between pools) instead of being pinned with
    # `kvflow prefill` / `kvflow decode`; their role above is then their starting pool.
    role_free: bool = False
    # Each role's --tensor-parallel-size (None: engine_args'); KV moves rank to rank between them (cluster/transfer/).
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None

    def tensor_parallel_size(self, role: str) -> int:
        size = self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size
        return self.engine_args.tensor_parallel_size if size is None else size

    def ranks_per_worker(self, role: str) -> int:
        """One process (and, on GPUs, one GPU) per tensor-parallel rank of each pipeline stage."""
        return self.tensor_parallel_size(role) * self.engine_args.pipeline_parallel_size

    def parallel_flags(self, role: str) -> str:
        flags = f"--tensor-parallel-size {self.tensor_parallel_size(role)}"
        pp = self.engine_args.pipeline_parallel_size
        return flags + (f" x --pipeline-parallel-size {pp}" if pp > 1 else "")

    def role_engine_args(self, role: str) -> EngineArgs:
        return dataclasses.replace(self.engine_args, tensor_parallel_size=self.tensor_parallel_size(role))
