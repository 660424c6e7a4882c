"""CPU weight offload (`--cpu-offload-gb N`, vLLM's `cpu_offload_gb`): "virtually more GPU memory".

Which weights: whole decoder layers, from the first one on, until at least N GiB are offloaded (or every layer),
as vLLM's `maybe_offload_to_cpu` fills its budget in layer order. The embeddings, the final norm and lm_head stay
on the GPU.

How they run: each offloaded layer's parameters live in one flat host buffer (pinned on CUDA). One staging buffer
of a layer's size sits on the compute device, and the parameters of every offloaded layer are views into it; right
before an offloaded layer runs, its host buffer is copied into the staging buffer (one non-blocking copy on the
current stream). The layer then computes exactly as it would with resident weights: same kernels, same values.

Why one staging buffer on the current stream, not a prefetch stream with two: the step is bound by the copies
(a decode step of an offloaded Llama-8B layer computes in ~0.2 ms; its 0.4 GiB copy takes ~8 ms over PCIe 5), so
overlapping the copies with compute could hide only the offloaded layers' compute, and a second buffer would cost
another layer of GPU memory. Stream order alone makes it correct: layer i's copy is queued after layer i-1's
kernels that read the buffer.

CUDA graphs: the decode graphs capture the copies (cudaMemcpyAsync from pinned host memory is capturable) together
with the layers, so graphs stay on. The addresses baked in (host buffers, staging buffer) live as long as the
model.

GPU memory: the resident weights plus one staging buffer; the runner's memory profile measures exactly that, so
the KV cache gets the rest. Offloading k layers frees k - 1 layers of GPU memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 256  # byte alignment of each parameter inside the flat buffers (what the GEMM kernels like)


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
        return self.layer_bytes if self.num_layers else 0

    @property
    def gpu_bytes_saved(self) -> int:
        return self.offloaded_bytes - self.staging_bytes


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
    """The offloaded layers' weights in host memory, streamed through one staging buffer on `compute_device`.

    Two phases: once built over the layers, their parameters are views of the host buffers (layers built on the
    "meta" device give only shapes and dtypes; others have their values copied), so loading weights writes host
    memory directly and the GPU never holds them. `activate()` then points the parameters at the staging buffer; from then on `load(i)`
    must run before layer i computes (CausalLM.forward does).
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
        self.staging: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.host)

    @property
    def host_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def activate(self) -> None:
        """Allocate the staging buffer and point every offloaded parameter at it (after the weights are loaded)."""
        self.staging = torch.empty(self.layer_bytes, dtype=torch.uint8, device=self.compute_device)
        for slots in self._slots:
            for slot in slots:
                _bind(slot, _typed(self.staging, slot))

    def load(self, index: int) -> None:
        """Queue the copy of offloaded layer `index`'s weights into the staging buffer (before that layer runs)."""
        if self.staging is None:
            raise RuntimeError("LayerWeightStream.load before activate()")
        self.staging.copy_(self.host[index], non_blocking=True)


def _bind(slot: _Slot, tensor: torch.Tensor) -> None:
    """Make the parameter a view of `tensor` (a new Parameter: `.data =` cannot move a meta tensor to a device)."""
    setattr(slot.module, slot.name, nn.Parameter(tensor, requires_grad=False))
