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
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

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


class KVPort:
    def __init__(self, kv_caches: list[KVCache], dtype: str, kv_scales: tuple[float, ...] = ()) -> None:
        key = kv_caches[0][0]
        _, block_size, heads, head_dim = key.shape
        self.layout = KVLayout(dtype, len(kv_caches), block_size, heads, head_dim, kv_scales=kv_scales)
        self.device = key.device
        # fp8 caches are moved as bytes: CPU index_copy_ has no float8 kernel.
        self._caches = [(k.view(torch.uint8), v.view(torch.uint8)) if k.dtype == torch.float8_e4m3fn else (k, v)
                        for k, v in kv_caches]
        self._num_blocks = key.shape[0]

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
    def export(self, block_ids: list[int], part: KVSlice) -> KVExport:
        """Gather request blocks `block_ids` (the slice's, in order) into one wire tensor."""
        index = self._index(block_ids, part)
        layers = self._caches[part.first_layer : part.first_layer + part.num_layers]
        out = torch.empty(self.layout.wire_shape(part), dtype=self.layout.torch_dtype, device=self.device)
        raw = out.view(layers[0][0].dtype)
        for layer, (k, v) in enumerate(layers):
            torch.index_select(k, 0, index, out=raw[layer, 0])
            torch.index_select(v, 0, index, out=raw[layer, 1])
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

    def empty_wire(self, part: KVSlice) -> torch.Tensor:
        """A receive buffer for one slice, on the engine's device."""
        return torch.empty(self.layout.wire_shape(part), dtype=self.layout.torch_dtype, device=self.device)

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
        for offset in range(part.num_layers):
            k, v = self._caches[part.first_layer + offset]
            k.index_copy_(0, index, src[offset, 0])
            v.index_copy_(0, index, src[offset, 1])
        done = None
        if self.on_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        return KVImport(done)
