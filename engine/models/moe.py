"""The sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral) and the decoder that places it: a router picks
`top_k` of `num_experts` SwiGLU experts per token, and the token's output is the routing-weighted sum of theirs,
plus, where the config has one (Qwen2-MoE), a shared expert's output scaled by its sigmoid gate.

Invariants:
- Routing is transformers' arithmetic: an fp32 softmax over every expert's logit, the top k, renormalized to sum
  to one when `MoEArch.renormalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral always, which is the same as a softmax
  over the top-k logits), the weights then cast to the activations' dtype. fp32 routes as HF routes.
- On the fused (CUDA) path, once `prepare_fused_weights` stacked the experts' weights, the routed experts run as
  Triton kernels: a few tokens (decode) as kernels/moe_gemv.py's per-slot GEMVs, more as kernels/fused_moe.py's
  two grouped GEMMs; no host read, so decode steps are graph-captured at sparse cost. Half-precision routing there
  is one kernel (kernels/moe_route.py), same arithmetic; a single row's router logits come from the one-row GEMV.
- Otherwise the experts run as the torch reference: a loop over the experts that got tokens (idle experts cost
  nothing), in ascending expert id, each adding its weighted rows into the output as HF's loop does. While a CUDA
  graph is captured the active experts cannot be read on the host, so every expert runs on every token, weighted
  zero where it was not picked: the same sums at dense cost.
- A block holds the experts `expert_ids` names (all of them unless expert parallelism deals them out), each whole
  or (tensor parallelism without expert parallelism) a run of its intermediate rows; its output is this rank's
  partial sum, which the decoder layer all-reduces like a row-parallel MLP's.
- Expert `e`'s weights are the checkpoint's `experts.{e}` modules: the parameters are named after the global id.
- Expert load: each block counts the tokens routed to every expert (all of them, not only this rank's) in a
  device buffer, without a host read; `MoECausalLM.take_expert_load` reads and clears them once per engine step.
  Forwards replayed from CUDA graphs are not counted (the count is taken on the eager path only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ModelArch, MoEArch
from engine.models.layers import Collectives, SmallGemmMode
from engine.models.llama import CausalLM, DecoderLayer, uses_small_gemm
from engine.models.weight_map import TPSplit, column_parallel, row_parallel
from engine.parallel.layout import RankShard
from engine.runner.attention import AttentionBackend
from kernels.fused_moe import fused_moe
from kernels.moe_gemv import gemv_suits, moe_gemv
from kernels.moe_route import MAX_EXPERTS as MAX_ROUTED_EXPERTS
from kernels.moe_route import moe_route, moe_route_ref


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype, fused: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in `dtype`, expert ids [T, k]), as transformers computes them.
    `fused` (the Triton path) with half-precision activations: one kernel (kernels/moe_route.py) instead of the
    five to seven of the torch ops; fp32 keeps the torch ops, bit-equal to HF's."""
    if fused and dtype in (torch.bfloat16, torch.float16) and logits.shape[-1] <= MAX_ROUTED_EXPERTS:
        return moe_route(logits.contiguous(), top_k, renormalize, dtype)
    return moe_route_ref(logits, top_k, renormalize, dtype)


class Expert(nn.Module):
    """One SwiGLU expert: gate|up fused on load (as the dense MLP), then down."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class SparseMoeBlock(nn.Module):
    """The router (`gate`, replicated) and this rank's experts, keyed by global expert id."""

    def __init__(self, hidden_size: int, moe: MoEArch, expert_ids: range | None = None,
                 intermediate_size: int | None = None, shared_intermediate_size: int | None = None) -> None:
        """`expert_ids`, `intermediate_size` and `shared_intermediate_size`: this rank's experts, its rows of each
        and of the shared expert (default: all)."""
        super().__init__()
        self.moe = moe
        self.expert_ids = range(moe.num_experts) if expert_ids is None else expert_ids
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        rows = moe.expert_intermediate_size if intermediate_size is None else intermediate_size
        self.experts = nn.ModuleDict({str(e): Expert(hidden_size, rows) for e in self.expert_ids})
        shared = moe.shared_expert_intermediate_size if shared_intermediate_size is None else shared_intermediate_size
        self.shared_expert = Expert(hidden_size, shared) if moe.shared_expert_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if self.shared_expert is not None else None
        # tokens routed to each expert since the last take (engine metrics), a buffer: moves with the model
        self.register_buffer("load", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        # this rank's experts stacked for the fused kernel ([E_local, 2I, H] and [E_local, H, I]); None: the loop
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.small_gemm_mode = SmallGemmMode.from_env()  # the router's one-row GEMV, as the dense layers' (or off)

    def stack_experts(self) -> None:
        """Lay this rank's experts out as the fused kernel reads them. Each expert's own weights become views of
        the stacked tensors, so the model holds one copy and both paths read the same values."""
        experts = [self.experts[str(e)] for e in self.expert_ids]
        with torch.no_grad():
            self.w13 = torch.stack([expert.gate_up_proj.weight for expert in experts])
            self.w2 = torch.stack([expert.down_proj.weight for expert in experts])
        for i, expert in enumerate(experts):
            expert.gate_up_proj.weight = nn.Parameter(self.w13[i], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(self.w2[i], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.w13 is not None
        weights, ids = route(self._router_logits(x, fused), self.moe.top_k, self.moe.renormalize, x.dtype, fused)
        if fused:
            routed = self._fused_experts(x, weights, ids)
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            routed = self._all_experts(x, weights, ids)
        else:
            routed = self._routed_experts(x, weights, ids)
        if self.shared_expert is None or self.shared_expert_gate is None:
            return routed
        # HF's order: the routed sum plus the gated shared expert (this rank's rows of it: a partial sum too)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _router_logits(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """The replicated router; a single half-precision row on the fused path streams its weight through the
        one-row GEMV (kernels/small_gemm.py), as the dense layers' batch-1 linears do, instead of cuBLAS; with
        their switch (KVFLOW_SMALL_GEMM=0: cuBLAS everywhere)."""
        if fused and self.small_gemm_mode.enabled and uses_small_gemm(x):
            return self.small_gemm_mode.linear(x, self.gate.weight)[0]
        return self.gate(x)

    def _fused_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts through the Triton kernels: a few tokens as per-slot GEMVs (kernels/moe_gemv.py),
        more through the sorted grouped GEMMs (kernels/fused_moe.py). Another rank's experts fall outside
        [start, start + E_local), which both skip."""
        assert self.w13 is not None and self.w2 is not None  # the caller checked (forward)
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):  # counted on the eager path only
            flat = ids.flatten()
            self.load.scatter_add_(0, flat, torch.ones_like(flat))
        start = self.expert_ids.start
        if gemv_suits(ids.numel(), self.moe.num_experts):
            return moe_gemv(x.contiguous(), self.w13, self.w2, weights, ids, start)
        return fused_moe(x.contiguous(), self.w13, self.w2, weights, ids - start if start else ids)

    def _routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The reference loop over this rank's experts that got tokens."""
        out = torch.zeros_like(x)
        first = self.expert_ids.start
        counts = torch.bincount(ids.flatten(), minlength=self.moe.num_experts)
        self.load += counts
        hits = counts[first : self.expert_ids.stop]
        for local in hits.nonzero().flatten().tolist():  # one host read: which of this rank's experts got tokens
            tokens, slot = torch.where(ids == first + local)
            y = self.experts[str(first + local)](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted zero where not routed: no host read (CUDA-graph capture)."""
        dense = torch.zeros(x.shape[0], self.moe.num_experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in self.expert_ids:
            out.add_(self.experts[str(e)](x) * dense[:, e, None])
        return out


class MoECausalLM(CausalLM):
    """The Llama-family decoder (attention, norms, rotary, tensor-parallel embedding and head) with the sparse block
    as the MLP of `arch.moe.sparse_layers` and the dense SwiGLU elsewhere. Subclasses name the checkpoint's
    weights. Under tensor parallelism attention and dense MLPs are split as in `CausalLM` and the router is
    replicated; each rank holds every expert sliced (`expert_tp_plan`: gate|up column-, down row-parallel), or,
    with expert parallelism, the whole experts of its `shard.experts` run. Dummy weights are drawn per parameter
    name, so every layout holds the same model."""

    expert_tp_plan: ClassVar[Mapping[str, TPSplit]] = {
        "gate_proj": column_parallel("expert_intermediate"), "up_proj": column_parallel("expert_intermediate"),
        "down_proj": row_parallel("expert_intermediate"),
    }
    # llama.cpp's MoE tensors (`ffn_gate_exps`, stacked experts) have no mapping: GGUF-quantized MoE is refused
    gguf_tensor_names: ClassVar[Mapping[str, str]] = {}
    gguf_permuted_heads: ClassVar[Mapping[str, str]] = {}

    def __init__(self, arch: ModelArch, hf_config: Any, backend: AttentionBackend, max_positions: int,
                 fused_ops: bool = False, shard: RankShard | None = None, group: Collectives | None = None,
                 host_layers: int = 0) -> None:
        if arch.moe is None:
            raise ValueError(f"{arch.architecture} needs an MoE config (num_experts, num_experts_per_tok)")
        super().__init__(arch, hf_config, backend, max_positions, fused_ops, shard, group, host_layers)

    def dummy_seed(self, seed: int, index: int, name: str) -> int:
        """By name, not position: an expert-parallel rank lacks the other ranks' experts, so positions shift."""
        return seed * 1000 + int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")

    def take_expert_load(self) -> np.ndarray:
        """Tokens routed to each expert [sparse layer, expert] since the last call, and the counts cleared: one
        host read. Every rank routes every token, so rank 0's counts cover all experts."""
        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        if not blocks:
            return np.zeros((0, 0), dtype=np.int64)
        load = torch.stack([block.load for block in blocks]).cpu().numpy()
        for block in blocks:
            block.load.zero_()
        return load

    def prepare_fused_weights(self) -> None:
        """Stack every sparse block's experts for the fused MoE kernel (the CUDA path, after loading)."""
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.stack_experts()

    def build_layer(self, index: int, arch: ModelArch, backend: AttentionBackend, fused_ops: bool) -> nn.Module:
        moe = arch.moe  # never None here (__init__)
        if moe is None or index not in moe.sparse_layers:
            return DecoderLayer(arch, backend, fused_ops, self.shard, self.group)
        mlp = SparseMoeBlock(arch.hidden_size, moe, range(*self.shard.experts), self.shard.expert_intermediate_size,
                             self.shard.shared_expert_intermediate_size)
        return DecoderLayer(arch, backend, fused_ops, self.shard, self.group, mlp=mlp)
