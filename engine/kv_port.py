"""The engine's KV cache as a transfer sees it: the one seam between the engine and any KV transport.

A transport never touches the cache tensors, the scheduler or the runner. It asks the port to `export` blocks
(gather them into one contiguous tensor in the wire layout, `engine.kv_layout`) and to `import_` a wire tensor
into blocks the engine reserved for a remote prefill.

Threads and streams (the invariants the callers keep):
- `export` runs on the engine thread between steps, right after the step that computed the blocks, on the
  engine's stream. It returns a `KVExport`; on CUDA its `ready` event marks the end of the gather, so another
  stream can read the tensor without waiting for later steps. The blocks may be freed afterwards.
- `import_` runs on a transfer thread inside `transfer_stream()`, never on the engine thread. Its target blocks
  belong to a request waiting for remote KV, which no scheduled step reads or writes. The caller waits for the
  copy to complete (`KVImport.wait`) before it tells the engine the blocks are filled, so the engine's stream
  needs no cross-stream wait, and a hung peer can only ever block the transfer thread.
- Host-tier copies an admission queued (saving the reserved blocks' old content, loading a cached prefix) end
  at the event the engine hands to `after`; `import_` makes its stream wait for the latest such event before it
  writes. The copies run in queue order on one stream, so the latest event covers every earlier one.

Tensor parallelism: each rank holds only its KV heads (`KVRanks.heads`); the port wraps rank 0's cache, and a
transport reaches the other ranks' caches through their own agents (`KVRanks.tell`, in step order). `export` can
gather a subset of the local heads, so a rank sends each peer rank only the heads it needs.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.kv_layout import KVLayout, KVSlice, KVTransferError

KVCache = tuple[torch.Tensor, torch.Tensor]
POLL_S = 0.0002  # how often a waiting transfer thread checks a CUDA event


@dataclass(frozen=True)
class KVExport:
    part: KVSlice
    tensor: torch.Tensor  # [layers, 2, blocks, block_size, heads, dim], contiguous, on the engine's device
    ready: torch.cuda.Event | None  # CUDA: recorded after the gather on the engine's stream

    def wait(self) -> None:
        """Make the current stream (a transfer thread's) wait for the gather: a device-side wait only."""
        if self.ready is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.ready)


@dataclass(frozen=True)
class KVImport:
    done: torch.cuda.Event | None  # CUDA: recorded after the scatter on the transfer stream

    def wait(self, deadline_s: float | None = None) -> bool:
        """Block this (transfer) thread until the copy has completed; False if `deadline_s` (monotonic) passed
        first. Polls instead of synchronizing so a hung device operation never pins the thread for good."""
        if self.done is None:
            return True
        while not self.done.query():
            if deadline_s is not None and time.monotonic() > deadline_s:
                return False
            time.sleep(POLL_S)
        return True


@dataclass(frozen=True)
class KVRanks:
    """Where a worker's KV heads live across its tensor-parallel ranks, and how a transport reaches ranks > 0."""

    heads: tuple[tuple[int, ...], ...]  # per rank: the model's KV head behind each local KV head (may repeat)
    # rank 0 -> every other rank's transfer agent, a frame in step order (None with one rank)
    tell: Callable[[bytes], None] | None = field(default=None, compare=False)
    check: Callable[[], None] | None = field(default=None, compare=False)  # raises once a rank is gone
    store: Any = field(default=None, compare=False)  # the ranks' shared c10d store: ranks > 0 report there

    @property
    def size(self) -> int:
        return len(self.heads)

    @staticmethod
    def single(num_kv_heads: int) -> KVRanks:
        return KVRanks((tuple(range(num_kv_heads)),))


class KVPort:
    def __init__(self, kv_caches: list[KVCache], dtype: str, kv_scales: tuple[float, ...] = (),
                 ranks: KVRanks | None = None, rank: int = 0) -> None:
        key = kv_caches[0][0]
        _, block_size, heads, head_dim = key.shape
        self.layout = KVLayout(dtype, len(kv_caches), block_size, heads, head_dim, kv_scales=kv_scales)
        self.ranks = ranks if ranks is not None else KVRanks.single(heads)
        self.rank = rank  # which of `ranks` this port's cache is
        if len(self.ranks.heads[rank]) != heads:
            raise ValueError(f"rank {rank} holds {heads} KV heads, but its layout says {self.ranks.heads[rank]}")
        self.device = key.device
        # fp8 caches are moved as bytes: CPU index_copy_ has no float8 kernel.
        self._caches = [(k.view(torch.uint8), v.view(torch.uint8)) if k.dtype == torch.float8_e4m3fn else (k, v)
                        for k, v in kv_caches]
        self._num_blocks = key.shape[0]
        self._tier_copies_done: torch.cuda.Event | None = None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _index(self, block_ids: list[int], part: KVSlice) -> torch.Tensor:
        if len(block_ids) != part.num_blocks:
            raise KVTransferError("bad_stream", f"{len(block_ids)} block ids for a slice of {part.num_blocks}")
        if part.first_layer < 0 or part.first_layer + part.num_layers > self.layout.num_layers:
            raise KVTransferError("bad_stream", f"slice layers {part} exceed the model's {self.layout.num_layers}")
        if any(b < 0 or b >= self._num_blocks for b in block_ids):
            raise KVTransferError("bad_stream", "block id outside the KV cache")
        return torch.as_tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)

    # ---- engine thread -------------------------------------------------------------------------------------
    def after(self, tier_copies_done: torch.cuda.Event) -> None:
        """Imports from now on wait (on the device) for the host-tier copies queued up to this event."""
        self._tier_copies_done = tier_copies_done

    def heads_layout(self, num_heads: int) -> KVLayout:
        """The wire layout of a message carrying `num_heads` of the local heads."""
        return replace(self.layout, num_kv_heads=num_heads)

    def export(self, block_ids: list[int], part: KVSlice, heads: tuple[int, ...] | None = None) -> KVExport:
        """Gather request blocks `block_ids` (the slice's, in order) into one wire tensor; with `heads`, only those
        local KV heads, in that order."""
        index = self._index(block_ids, part)
        layers = self._caches[part.first_layer : part.first_layer + part.num_layers]
        layout = self.layout if heads is None else self.heads_layout(len(heads))
        out = torch.empty(layout.wire_shape(part), dtype=layout.torch_dtype, device=self.device)
        raw = out.view(layers[0][0].dtype)
        if heads is None:
            for layer, (k, v) in enumerate(layers):
                torch.index_select(k, 0, index, out=raw[layer, 0])
                torch.index_select(v, 0, index, out=raw[layer, 1])
        else:
            if any(h < 0 or h >= self.layout.num_kv_heads for h in heads):
                raise KVTransferError("bad_stream", f"KV heads {heads} outside this rank's {self.layout.num_kv_heads}")
            picked = torch.as_tensor(heads, dtype=torch.int64).to(self.device, non_blocking=True)
            for layer, (k, v) in enumerate(layers):
                raw[layer, 0].copy_(k.index_select(0, index).index_select(2, picked))
                raw[layer, 1].copy_(v.index_select(0, index).index_select(2, picked))
        ready = None
        if self.on_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return KVExport(part, out, ready)

    # ---- transfer thread ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def transfer_stream(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Run the block's device work on `stream` (a transfer thread's own; None on CPU)."""
        if stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield

    def new_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(self.device) if self.on_cuda else None

    def empty_wire(self, part: KVSlice, num_heads: int | None = None) -> torch.Tensor:
        """A receive buffer for one slice (of `num_heads` heads, default all local ones), on the engine's device."""
        layout = self.layout if num_heads is None else self.heads_layout(num_heads)
        return torch.empty(layout.wire_shape(part), dtype=layout.torch_dtype, device=self.device)

    def wire_from_bytes(self, part: KVSlice, data: bytes) -> torch.Tensor:
        """A host wire tensor viewing received bytes (validated against the layout)."""
        expected = self.layout.payload_bytes(part.num_blocks, part.num_layers)
        if len(data) != expected:
            raise KVTransferError("bad_payload", f"KV chunk has {len(data)} bytes for {part.num_blocks} blocks x "
                                                 f"{part.num_layers} layers; expected {expected}")
        with warnings.catch_warnings():  # read-only source: it is only copied from, never written
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        return raw.view(self.layout.torch_dtype).view(self.layout.wire_shape(part))

    def import_(self, block_ids: list[int], part: KVSlice, wire: torch.Tensor) -> KVImport:
        """Write a received slice into local blocks `block_ids` (the slice's, in order), on the current stream."""
        if tuple(wire.shape) != self.layout.wire_shape(part) or wire.dtype != self.layout.torch_dtype:
            raise KVTransferError("bad_payload", f"KV slice tensor {tuple(wire.shape)} {wire.dtype} does not match "
                                                 f"{self.layout.wire_shape(part)} {self.layout.dtype}")
        index = self._index(block_ids, part)
        src = wire.to(self.device, non_blocking=True).view(self._caches[0][0].dtype)
        tier_copies_done = self._tier_copies_done
        if tier_copies_done is not None:
            torch.cuda.current_stream(self.device).wait_event(tier_copies_done)
        for offset in range(part.num_layers):
            k, v = self._caches[part.first_layer + offset]
            k.index_copy_(0, index, src[offset, 0])
            v.index_copy_(0, index, src[offset, 1])
        done = None
        if self.on_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        return KVImport(done)
