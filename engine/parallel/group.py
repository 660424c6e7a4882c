"""A tensor-parallel process group of its own (never torch's global default group): the collectives the model
needs (and the point-to-point sends between pipeline stages), over NCCL between GPUs (called directly on the caller's stream, engine/parallel/nccl.py, so CUDA graphs
capture them) or gloo on CPUs (each call bounded by a timeout). On GPUs a stuck collective is ended by the driver's
watchdog aborting the communicator (engine/parallel/executor.py)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.hang_report import CallLog
from engine.parallel.nccl import NcclCommunicator, NcclLibrary
from engine.parallel.nccl_env import set_nccl_env_defaults
from engine.parallel.peer_all_reduce import PeerAllReduce

set_nccl_env_defaults()  # before any communicator of this process exists

DEFAULT_TIMEOUT_S = 120.0
logger = logging.getLogger(__name__)


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


def _listening_fd(host: str, port: int) -> int:
    """A socket listening on host:port alone, handed (with its ownership) to the TCPStore's server."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


class TPGroup:
    """`size` ranks joined through a c10d TCPStore at host:port (rank 0 hosts it, listening on `host` alone: c10d's
    own server would listen on every interface, open to anyone who reaches the machine)."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: torch.device,
                 timeout_s: float | None = None, store: Any = None, prefix: str = "kvflow-tp") -> None:
        """`store`: join through an existing store (a pipeline stage's group on its world's store, under its own
        `prefix`) instead of a new one at host:port."""
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s if timeout_s is not None else tp_timeout_s()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = store if store is not None else dist.TCPStore(
            host, port, size, is_master=rank == 0, timeout=timeout,
            master_listen_fd=_listening_fd(host, port) if rank == 0 else None)
        prefixed = dist.PrefixStore(prefix, self.store)
        self._prefixed = prefixed
        self.peer: PeerAllReduce | None = None  # small all-reduces over peer memory (enable_peer_all_reduce)
        self._peer_why: str | None = None  # why the one-shot was not set up when asked for (None: not asked)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.nccl: NcclCommunicator | None = None
        self.calls = CallLog()  # what this rank issued on the group (engine/parallel/hang_report.py)
        # Small host-side agreements (the KV block count) go over gloo whatever the device.
        self.cpu_pg: Any = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        if self.backend == "nccl":
            library = NcclLibrary()
            if rank == 0:
                unique_id = library.unique_id()
                prefixed.set("nccl-unique-id", unique_id)
            else:
                unique_id = prefixed.get("nccl-unique-id")
            self.nccl = NcclCommunicator(library, unique_id, rank, size, device)

    def enable_peer_all_reduce(self, **options: Any) -> None:
        """Collective (every rank calls it): run all-reduces up to a size threshold one-shot over peer GPU memory
        (engine/parallel/peer_all_reduce.py), NCCL above it. If any rank cannot map its peers' memory, every rank
        keeps NCCL. `options`: PeerAllReduce.setup's max_bytes / programs."""
        if self.nccl is None or self.size == 1 or self.peer is not None:
            return
        self.peer, why = PeerAllReduce.setup(self._prefixed, self.rank, self.size, self.device, self.timeout_s,
                                             **options)
        self._peer_why = why
        if self.peer is None:
            logger.warning("tensor-parallel all-reduce stays on NCCL: %s", why)

    @property
    def all_reduce_kind(self) -> str:
        """Which all-reduce runs (the worker's Info): the peer one-shot and its threshold, NCCL or gloo."""
        if self.peer is not None:
            return self.peer.describe()
        if self.nccl is None:
            return self.backend
        return "nccl" if self._peer_why is None else f"nccl (peer one-shot unavailable: {self._peer_why})"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place across ranks (row-parallel outputs, the vocab-parallel embedding)."""
        self.calls.record("all_reduce", tuple(tensor.shape), tensor.dtype)
        if self.peer is not None and self.peer.fits(tensor):
            return self.peer(tensor)
        if self.nccl is not None:
            return self.nccl.all_reduce(tensor)
        self.cpu_pg.allreduce([tensor]).wait()
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """Join each rank's [rows, local] tensor along the last dimension, each padded to `width` columns."""
        if tensor.shape[-1] < width:
            tensor = torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
        tensor = tensor.contiguous()
        self.calls.record("all_gather", tuple(tensor.shape), tensor.dtype)
        if self.nccl is not None:
            return join_gathered(self.nccl.all_gather(tensor))
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.cpu_pg.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point to point (pipeline stages' activations): `tensor` (contiguous) to rank `dst`."""
        self.calls.record("send", tuple(tensor.shape), tensor.dtype, dst)
        if self.nccl is not None:
            self.nccl.send(tensor, dst)
            return
        self.cpu_pg.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `tensor` (contiguous) with what rank `src` sends."""
        self.calls.record("recv", tuple(tensor.shape), tensor.dtype, src)
        if self.nccl is not None:
            return self.nccl.recv(tensor, src)
        self.cpu_pg.recv([tensor], src, 0).wait()
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (host side)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self.calls.record("min_int", (1,), tensor.dtype)
        self.cpu_pg.allreduce([tensor], _min_opts()).wait()
        return int(tensor.item())

    def close(self, failed: bool = False) -> None:
        """Release the communicators. NCCL's always aborts: destroying waits for the other ranks, which are
        stopped first, so it could hang rank 0 at exit. Gloo's: `abort` after a failure (pending operations end
        with an error), else `shutdown`. The peer all-reduce's memory is released only after a clean run: after a
        failure a one-shot kernel may still wait for a dead peer, and freeing would block on it (exit frees it)."""
        peer, self.peer = self.peer, None
        if peer is not None and not failed:
            peer.close()
        if self.nccl is not None and not self.nccl.close(abort=True):
            logger.warning("the NCCL communicator did not close in time; the process exit releases it")
        for name in (("abort", "shutdown") if failed else ("shutdown", "abort")):
            method = getattr(self.cpu_pg, name, None)
            if method is not None:
                with contextlib.suppress(Exception):
                    method()
                break


def join_gathered(gathered: torch.Tensor) -> torch.Tensor:
    """[size, *lead, width] (each rank's tensor, as NCCL's all-gather stacks them) -> [*lead, size * width]: the
    ranks' columns side by side, as torch.cat(parts, dim=-1)."""
    dims = gathered.dim()
    return gathered.permute(*range(1, dims - 1), 0, dims - 1).flatten(-2)


def _min_opts() -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts
