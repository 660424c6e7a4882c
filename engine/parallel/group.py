"""A tensor-parallel process group of its own (never torch's global default group): the collectives the model
needs, over NCCL between GPUs or gloo on CPUs, each bounded by a timeout so a dead rank fails a step instead of
hanging it."""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) is off limits on shared hosts; a timed-out NCCL operation must abort the communicator
# and raise, not wait forever.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")

DEFAULT_TIMEOUT_S = 120.0


def tp_timeout_s() -> float:
    """KVFLOW_TP_TIMEOUT_S bounds every collective and the rendezvous (default 120 s)."""
    raw = os.environ.get("KVFLOW_TP_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError as exc:
        raise ValueError(f"KVFLOW_TP_TIMEOUT_S must be a number of seconds, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"KVFLOW_TP_TIMEOUT_S must be > 0, got {raw!r}")
    return value


class TPGroup:
    """`size` ranks joined through a c10d TCPStore at host:port (rank 0 hosts it)."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: torch.device,
                 timeout_s: float | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s if timeout_s is not None else tp_timeout_s()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("kvflow-tp", self.store)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        # Small host-side agreements (the KV block count) go over gloo whatever the device.
        self.cpu_pg: Any = self.pg if self.backend == "gloo" else dist.ProcessGroupGloo(
            dist.PrefixStore("kvflow-tp-cpu", self.store), rank, size, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place across ranks (row-parallel outputs, the vocab-parallel embedding)."""
        self.pg.allreduce([tensor]).wait()
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """Join each rank's [rows, local] tensor along the last dimension, each padded to `width` columns."""
        if tensor.shape[-1] < width:
            tensor = torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.pg.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (host side)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self.cpu_pg.allreduce([tensor], _min_opts()).wait()
        return int(tensor.item())

    def close(self, failed: bool = False) -> None:
        """Release the communicators. NCCL's always `abort`s: its `shutdown` (ncclCommFinalize) waits for the other
        ranks, which are stopped first, so it hung rank 0 at exit on the GPU. Gloo's: `abort` after a failure
        (pending operations end with an error), else `shutdown`."""
        for pg in {id(self.pg): self.pg, id(self.cpu_pg): self.cpu_pg}.values():
            nccl = pg is self.pg and self.backend == "nccl"
            for name in (("abort", "shutdown") if failed or nccl else ("shutdown", "abort")):
                method = getattr(pg, name, None)
                if method is not None:
                    with contextlib.suppress(Exception):
                        method()
                    break


def _min_opts() -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts
