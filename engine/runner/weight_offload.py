"""CPU weight offload (`--cpu-offload-gb N`, vLLM's `cpu_offload_gb`): "virtually more GPU memory".

Which weights: whole decoder layers, from the first one on, until at least N GiB are offloaded (or every layer),
as vLLM's `maybe_offload_to_cpu` fills its budget in layer order. The embeddings, the final norm and lm_head stay
on the GPU.

How they run: each offloaded layer's parameters live in one flat host buffer (pinned on CUDA). Two staging buffers
of a layer's size sit on the compute device (one if only one layer is offloaded); offloaded layer i's parameters
are views into buffer i % 2. The copies run on a stream of their own, one layer ahead of the compute, as vLLM's
offload overlaps them: before a forward, layers 0 and 1 are copied in; layer i waits for its copy, and once layer
i's kernels are queued, layer i + 2 is copied into the same buffer after them. Each layer computes exactly as it
would with resident weights: same kernels, same values.

What the overlap buys: a decode step is bound by the copies (a Llama-8B layer computes in ~0.2 ms at decode and
copies 0.4 GiB in ~8 ms over PCIe 5), so there it hides only the offloaded layers' compute; a prefill chunk's
layer computes for milliseconds, and that now runs while the next layer's weights arrive. The cost is the second
buffer: one more layer of GPU memory.

CUDA graphs: the decode graphs capture the copies (cudaMemcpyAsync from pinned host memory is capturable) and the
copy stream, which forks from and joins the capturing stream through events, so graphs stay on. The addresses
baked in (host buffers, staging buffers) live as long as the model.

GPU memory: the resident weights plus the staging buffers; the runner's memory profile measures exactly that, so
the KV cache gets the rest. Offloading k >= 2 layers frees k - 2 layers of GPU memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of each parameter inside the flat buffers (what the GEMM kernels like)
STAGING_BUFFERS = 2  # one layer computing from one while the next layer's weights land in the other


@dataclass(frozen=True)
class OffloadPlan:
    """How many leading decoder layers are offloaded, for a byte budget."""

    num_layers: int  # layers 0 .. num_layers - 1 live in host memory
    layer_bytes: int  # one layer's parameters (all layers of a model have the same)
    total_layers: int

    @property
    def offloaded_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def staging_bytes(self) -> int:
        return min(STAGING_BUFFERS, self.num_layers) * self.layer_bytes

    @property
    def gpu_bytes_saved(self) -> int:
        return self.offloaded_bytes - self.staging_bytes

    def log(self) -> None:
        gib = 2**30
        logger.info("cpu offload: layers 0-%d of %d (%.2f GiB) in pinned host memory, copied per forward (one layer "
                    "ahead, on a copy stream) through %.2f GiB of staging buffers: %.2f GiB of GPU memory freed",
                    self.num_layers - 1, self.total_layers, self.offloaded_bytes / gib, self.staging_bytes / gib,
                    self.gpu_bytes_saved / gib)
        if self.gpu_bytes_saved <= 0:
            logger.warning("cpu_offload_gb covers %d layer(s), which frees no GPU memory (the two staging buffers "
                           "are a layer each): offload at least three layers' worth (%.2f GiB) or none",
                           self.num_layers, 3 * self.layer_bytes / gib)


def plan_offload(budget_bytes: int, layer_bytes: int, total_layers: int) -> OffloadPlan:
    """Whole layers from the first until at least `budget_bytes` are offloaded (vLLM stops once its running total
    reaches the budget), capped at every layer; none for a budget of 0."""
    if budget_bytes < 0:
        raise ValueError(f"cpu_offload_gb must be >= 0, got {budget_bytes / 2**30:g} GiB")
    if layer_bytes <= 0:
        raise ValueError(f"a decoder layer must hold some weights, got {layer_bytes} bytes")
    return OffloadPlan(min(total_layers, math.ceil(budget_bytes / layer_bytes)), layer_bytes, total_layers)


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass(frozen=True)
class _Slot:
    module: nn.Module
    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int


def _layout(layer: nn.Module) -> tuple[list[tuple[str, torch.Size, torch.dtype, int, int]], int]:
    """(qualified name, shape, dtype, byte offset, bytes) of each parameter in the flat buffer, and its size."""
    entries, offset = [], 0
    for name, param in layer.named_parameters():
        nbytes = param.numel() * param.element_size()
        entries.append((name, param.shape, param.dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _owner(layer: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    path, _, name = qualified.rpartition(".")
    return (layer.get_submodule(path) if path else layer), name


def _typed(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class LayerWeightStream:
    """The offloaded layers' weights in host memory, streamed through staging buffers on `compute_device`.

    Two phases: once built over the layers, their parameters are views of the host buffers (layers built on the
    "meta" device give only shapes and dtypes; others have their values copied), so loading weights writes host
    memory directly and the GPU never holds them. `activate()` then points layer i's parameters at staging buffer
    i % 2; from then on a forward calls `start()`, `before_layer(i)` / `after_layer(i)` around each offloaded
    layer, and `finish()` (CausalLM.forward does).
    """

    def __init__(self, layers: Sequence[nn.Module], compute_device: torch.device,
                 host_device: torch.device = torch.device("cpu"), pin_memory: bool = True) -> None:
        if not layers:
            raise ValueError("no layers to offload")
        entries, self.layer_bytes = _layout(layers[0])
        self.compute_device = compute_device
        self.host: list[torch.Tensor] = []
        self._slots: list[list[_Slot]] = []
        for index, layer in enumerate(layers):
            mine, size = _layout(layer)
            if [(n, s, d) for n, s, d, _, _ in mine] != [(n, s, d) for n, s, d, _, _ in entries]:
                raise ValueError(f"offloaded layer {index} has other parameters than layer 0")
            flat = torch.empty(size, dtype=torch.uint8, device=host_device, pin_memory=pin_memory)
            slots = [_Slot(*_owner(layer, name), shape, dtype, offset, nbytes)
                     for name, shape, dtype, offset, nbytes in mine]
            for slot in slots:
                current = getattr(slot.module, slot.name)
                host = _typed(flat, slot)
                if current.device.type != "meta":  # a layer with values already: keep them
                    host.copy_(current.detach())
                _bind(slot, host)
            self.host.append(flat)
            self._slots.append(slots)
        self.buffers: list[torch.Tensor] = []
        self._cuda = compute_device.type == "cuda"
        self._copy_stream: torch.cuda.Stream | None = None
        self._copied: list[torch.cuda.Event] = []  # buffer b holds the layer it was last filled with
        self._released: list[torch.cuda.Event] = []  # the kernels queued before buffer b's refill are done with it

    @property
    def num_layers(self) -> int:
        return len(self.host)

    @property
    def host_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def activate(self) -> None:
        """Allocate the staging buffers and point each offloaded layer at its own (after the weights are loaded)."""
        count = min(STAGING_BUFFERS, self.num_layers)
        self.buffers = [torch.empty(self.layer_bytes, dtype=torch.uint8, device=self.compute_device)
                        for _ in range(count)]
        for index, slots in enumerate(self._slots):
            for slot in slots:
                _bind(slot, _typed(self.buffers[index % count], slot))
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(self.compute_device)
            self._copied = [torch.cuda.Event() for _ in range(count)]
            self._released = [torch.cuda.Event() for _ in range(count)]

    def load(self, index: int) -> None:
        """Queue the copy of offloaded layer `index` into its staging buffer, after every kernel queued so far on
        the current stream (the ones that read that buffer's previous layer)."""
        if not self.buffers:
            raise RuntimeError("LayerWeightStream.load before activate()")
        slot = index % len(self.buffers)
        if self._copy_stream is None:  # CPU: copies are synchronous, in program order
            self.buffers[slot].copy_(self.host[index])
            return
        self._released[slot].record(torch.cuda.current_stream(self.compute_device))
        self._copy_stream.wait_event(self._released[slot])
        with torch.cuda.stream(self._copy_stream):
            self.buffers[slot].copy_(self.host[index], non_blocking=True)
        self._copied[slot].record(self._copy_stream)

    def start(self) -> None:
        """A forward begins: copy in the first layers (one per buffer)."""
        for index in range(len(self.buffers)):
            self.load(index)

    def before_layer(self, index: int) -> None:
        """Offloaded layer `index` is about to run: its kernels wait for its weights."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.compute_device).wait_event(self._copied[index % len(self.buffers)])

    def after_layer(self, index: int) -> None:
        """Layer `index`'s kernels are queued: refill its buffer with the layer two ahead, after them."""
        ahead = index + len(self.buffers)
        if ahead < self.num_layers:
            self.load(ahead)

    def finish(self) -> None:
        """The forward is queued: the current stream joins the copy stream (a graph capture must end joined)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.compute_device).wait_stream(self._copy_stream)


def _bind(slot: _Slot, tensor: torch.Tensor) -> None:
    """Make the parameter a view of `tensor` (a new Parameter: `.data =` cannot move a meta tensor to a device)."""
    setattr(slot.module, slot.name, nn.Parameter(tensor, requires_grad=False))
