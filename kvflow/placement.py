"""Which GPU each worker of a `ClusterSpec` runs on, and its share of that GPU's memory.

Each worker owns one GPU (its tensor x pipeline ranks: consecutive GPUs from its first), from `--prefill-gpus` /
`--decode-gpus` or, by default, spread over the visible GPUs in order (prefill workers first). Workers that share a
GPU split vLLM's 0.9 memory share (0.45 each for two).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvflow.cluster_spec import ClusterSpec

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's; split between the workers sharing a GPU


@dataclass(frozen=True)
class Placement:
    role: str
    gpu: int | None  # index among the launcher's visible GPUs (rank 0's with tensor parallelism); None: CPU
    gpu_memory_utilization: float | None  # None: not a GPU worker
    tensor_parallel_size: int = 1  # ranks (tensor x pipeline) on consecutive GPUs gpu, gpu + 1, ...

    @property
    def gpus(self) -> set[int]:
        return set() if self.gpu is None else set(range(self.gpu, self.gpu + self.tensor_parallel_size))


def visible_gpus() -> list[str]:
    """The physical GPU ids this process may use (CUDA_VISIBLE_DEVICES order), without creating a CUDA context."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [d.strip() for d in listed.split(",") if d.strip()]
        return ids[:count]
    return [str(i) for i in range(count)]


def place_workers(spec: ClusterSpec, num_gpus: int) -> list[Placement]:
    """Which GPU each worker (prefill workers first, then decode) runs on, and its memory share."""
    roles = ["prefill"] * spec.prefill_workers + ["decode"] * spec.decode_workers
    device = spec.engine_args.device
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device}: a cluster places its workers itself; use --prefill-gpus / "
                         "--decode-gpus (indices among the visible GPUs), or CUDA_VISIBLE_DEVICES")
    if num_gpus == 0 or not (device == "auto" or device.startswith("cuda")):
        if spec.prefill_gpus or spec.decode_gpus:
            raise ValueError("--prefill-gpus/--decode-gpus need visible GPUs and --device auto or cuda")
        return [Placement(role, None, None) for role in roles]
    # Tensor and pipeline parallelism: a worker's ranks take consecutive GPUs from its (first) GPU on; each role has
    # its own tensor-parallel size.
    sizes = {role: spec.ranks_per_worker(role) for role in ("prefill", "decode")}
    for role, listed, count in (("prefill", spec.prefill_gpus, spec.prefill_workers),
                                ("decode", spec.decode_gpus, spec.decode_workers)):
        tp = sizes[role]
        if count and tp > num_gpus:
            raise ValueError(f"{spec.parallel_flags(role)} needs {tp} GPUs per worker, but {num_gpus} are visible"
                             + ("" if spec.tensor_parallel_size(role) == spec.engine_args.tensor_parallel_size
                                else f" ({role} workers)"))
        if listed is None:
            continue
        if len(listed) != count:
            raise ValueError(f"--{role}-gpus lists {len(listed)} GPUs for {count} {role} workers")
        if any(g < 0 or g + tp > num_gpus for g in listed):
            raise ValueError(f"--{role}-gpus {list(listed)}: only GPUs 0..{num_gpus - 1} are visible"
                             + (f" (each worker takes {tp} consecutive GPUs from its own)" if tp > 1 else ""))
    gpus: list[int] = []
    cursor = 0  # the default: each worker's GPUs right after the previous worker's, wrapping to GPU 0
    for role, listed in (("prefill", spec.prefill_gpus), ("decode", spec.decode_gpus)):
        for i in range(roles.count(role)):
            if listed is not None:
                gpus.append(listed[i])
                continue
            cursor = 0 if cursor + sizes[role] > num_gpus else cursor
            gpus.append(cursor)
            cursor += sizes[role]
    sharing = {g: 0 for g in range(num_gpus)}
    for role, gpu in zip(roles, gpus, strict=True):
        for g in range(gpu, gpu + sizes[role]):
            sharing[g] += 1
    placements = []
    for role, gpu in zip(roles, gpus, strict=True):
        share = spec.gpu_memory_utilization
        if share is None:
            most = max(sharing[g] for g in range(gpu, gpu + sizes[role]))
            share = math.floor(DEFAULT_GPU_MEMORY_UTILIZATION / most * 100) / 100
        placements.append(Placement(role, gpu, share, sizes[role]))
    return placements
