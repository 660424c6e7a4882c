"""Decoder-only transformer for the Llama family: Llama 2/3 (SmolLM2), Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Weights are fused on load (q|k|v, gate|up) so each layer runs four matmuls. The model works on a flat batch of
tokens from many sequences; attention reaches the paged KV cache through the backend it was built with.

The layers carry vLLM's residual stream (each norm takes the previous block's output and the running residual).
With `fused_ops` (the CUDA path) the norms, rotary embedding and SwiGLU run as the Triton kernels in kernels/;
without it (CPU) they are the plain torch ops, with exactly the arithmetic of `x = x + f(norm(x))`. The norm,
rotary and small-GEMM building blocks are in engine/models/layers.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ModelArch
from engine.models.layers import Collectives, RMSNorm, RotaryEmbedding, SmallGemmMode
from engine.models.weight_map import TPSplit, checkpoint_keys, column_parallel, is_norm_weight, row_parallel
from engine.parallel.layout import RankShard
from engine.parallel.stages import PipelineStage
from engine.quant.kv_fp8 import DEFAULT_KV_SCALES, KVScales
from engine.runner.attention import AttentionBackend, KVCache, TorchPagedAttention
from engine.runner.weight_offload import LayerWeightStream
from kernels.silu_and_mul import silu_and_mul
from kernels.small_gemm import prefers_gemv_head, small_gemm


class Attention(nn.Module):
    """Column-parallel q|k|v and row-parallel o under tensor parallelism: this rank's heads only (`shard`), and
    o_proj's partial sums are all-reduced by the caller (`DecoderLayer`)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, fused: bool = False,
                 shard: RankShard | None = None) -> None:
        super().__init__()
        shard = shard or RankShard.full(arch)
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, fused) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, fused) if arch.qk_norm else None
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.backend = backend
        self.fused = fused
        # fp8 KV cache: this layer's (k_scale, v_scale), calibrated ones set by the runner after loading
        self.kv_scales: KVScales = DEFAULT_KV_SCALES

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
                meta: object) -> torch.Tensor:
        out = self.attend(positions, self.qkv_proj(x), rotary, kv_cache, meta)
        return self.o_proj(out)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
               meta: object) -> torch.Tensor:
        """qkv [T, q + 2 kv] -> attention output [T, q] (before o_proj): q/k norms, rotary, KV write, attention."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:  # CUDA: the Triton backend rotates q/k while writing the KV (v stays a view of qkv)
            out = self.backend.forward_rotary(positions, q, k, v, kv_cache, meta, self.scale,  # type: ignore[attr-defined]
                                              rotary.cos_sin, self.kv_scales)
        else:
            if self.q_norm is None and isinstance(self.backend, TorchPagedAttention):
                # CPU fp32: rotary and the KV write (fp32 or fp8) as one compiled pass over qkv (None: not here)
                out = self.backend.forward_qkv(positions, qkv, rotary.cos_half, rotary.sin_half, self.num_heads,
                                               kv_cache, meta, self.scale, self.kv_scales)  # type: ignore[arg-type]
                if out is not None:
                    return out.reshape(num_tokens, self.q_size)
            if self.q_norm is None:  # q and k are adjacent in qkv: rotate them in one pass
                qk = rotary.rotate(positions, qkv[:, : self.q_size + self.kv_size].view(
                    num_tokens, self.num_heads + self.num_kv_heads, self.head_dim))
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            else:
                q, k = rotary(positions, q, k)
            out = self.backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale, self.kv_scales)
        return out.reshape(num_tokens, self.q_size)


CPU_MLP_ROWS = 1024
SMALL_GEMM_ROWS = 1


class MLP(nn.Module):
    """Column-parallel gate|up and row-parallel down under tensor parallelism (this rank's intermediate rows)."""

    def __init__(self, arch: ModelArch, fused: bool = False, shard: RankShard | None = None) -> None:
        super().__init__()
        self.intermediate = (shard or RankShard.full(arch)).intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, arch.hidden_size, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        if x.shape[0] <= CPU_MLP_ROWS:
            return self._swiglu(x)
        # Long prefills in row slices: the [rows, 2 * intermediate] activations then stay in cache instead of
        # streaming ~250 MB per layer through memory (rows are independent, so the result is the same).
        out = torch.empty(x.shape[0], self.down_proj.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, x.shape[0], CPU_MLP_ROWS):
            out[start : start + CPU_MLP_ROWS] = self._swiglu(x[start : start + CPU_MLP_ROWS])
        return out

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    """`mlp`: another MLP block in place of the dense SwiGLU (an MoE model's sparse block, engine/models/moe.py);
    its output, like the dense one's, is this rank's partial sum under tensor parallelism."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, fused: bool = False,
                 shard: RankShard | None = None, group: Collectives | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)
        self.self_attn = Attention(arch, backend, fused, shard)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)
        self.mlp = MLP(arch, fused, shard) if mlp is None else mlp
        self.group = group  # tensor parallelism: one all-reduce after o_proj, one after down_proj
        self.small_gemm_mode = SmallGemmMode.from_env()
        # the small-batch kernels fold the dense MLP's gate|up and down projections; another block (MoE) runs
        # its own kernels after the attention's GEMVs
        self.small_gemm = fused and self.small_gemm_mode.enabled

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, kv_cache: KVCache, meta: object) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous block's output (the embeddings for the first layer); returns (MLP output, residual)."""
        if self.small_gemm and uses_small_gemm(x):
            return self._forward_small_batch(positions, x, residual, rotary, kv_cache, meta)
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self._reduce(self.self_attn(positions, h, rotary, kv_cache, meta))
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self._reduce(self.mlp(h)), residual

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self.group.all_reduce(x)

    def _forward_small_batch(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                             rotary: RotaryEmbedding, kv_cache: KVCache, meta: object
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer for single-token steps on CUDA: the four linears as one-row GEMV kernels with SwiGLU
        (and, for narrow models, the residual-add + RMSNorm) folded in, instead of cuBLAS's split-K GEMM +
        reduce pairs and separate norm / activation kernels (kernels/small_gemm.py, `SmallGemmMode`)."""
        attn, mlp, mode = self.self_attn, self.mlp, self.small_gemm_mode
        if x.shape[-1] <= mode.norm_max_hidden:
            qkv, residual = _norm_linear(x, residual, self.input_layernorm, attn.qkv_proj, mode)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
            qkv = mode.linear(h, attn.qkv_proj.weight, bias=attn.qkv_proj.bias)[0]
        h = self._reduce(mode.linear(attn.attend(positions, qkv, rotary, kv_cache, meta), attn.o_proj.weight)[0])
        if not isinstance(mlp, MLP):
            h, residual = self.post_attention_layernorm.add_norm(h, residual)
            return self._reduce(mlp(h)), residual
        if h.shape[-1] <= mode.norm_max_hidden:
            gate_up, residual = _norm_linear(h, residual, self.post_attention_layernorm, mlp.gate_up_proj, mode)
        else:
            h, residual = self.post_attention_layernorm.add_norm(h, residual)
            gate_up = mode.linear(h, mlp.gate_up_proj.weight)[0]
        if mode.fuse_silu:
            return self._reduce(mode.linear(gate_up, mlp.down_proj.weight, prologue="silu")[0]), residual
        return self._reduce(mode.linear(silu_and_mul(gate_up), mlp.down_proj.weight)[0]), residual


def _meta_unless(real: bool) -> contextlib.AbstractContextManager[object]:
    """Build on the meta device (no memory, never loaded) unless `real`."""
    return contextlib.nullcontext() if real else torch.device("meta")


def uses_small_gemm(x: torch.Tensor) -> bool:
    """Single-token half-precision steps (batch-1 decode) take the fused small-batch GEMMs: with more rows their
    prologues run on a padded tile and lose to cuBLAS (measured, bench/GPU_NOTES.md); fp32 keeps cuBLAS, whose
    results the fp32 HF-equality checks compare against. Only models built with the Triton ops ask: on CUDA, or
    on CPU under Triton's interpreter in the tests."""
    return x.shape[0] <= SMALL_GEMM_ROWS and x.dtype in (torch.bfloat16, torch.float16)


def _norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, linear: nn.Linear,
                 mode: SmallGemmMode) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(residual + x)), residual + x) in one kernel; with no residual yet, x starts it."""
    y, residual_sum, _ = mode.linear(x, linear.weight, prologue="norm", bias=linear.bias, residual=residual,
                                     norm_weight=norm.weight, eps=norm.eps)
    return y, (x if residual_sum is None else residual_sum)


class CausalLM(nn.Module):
    """With `shard` and `group` (tensor parallelism, engine/parallel/): this rank's slice of every split weight,
    a vocab-parallel embedding (each rank embeds the ids in its rows, then one all-reduce) and lm_head (local
    logits all-gathered, so every rank, and the sampler, sees the full vocabulary).

    The class attributes declare its weights for the loaders and the sharder (engine/models/weight_map.py)."""

    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # Megatron-style: q|k|v and gate|up column-parallel, o and down row-parallel (one all-reduce after each);
    # the norms are replicated.
    tp_plan: ClassVar[Mapping[str, TPSplit]] = {
        "embed_tokens": column_parallel("vocab"), "lm_head": column_parallel("vocab"),
        "q_proj": column_parallel("q_heads"), "k_proj": column_parallel("kv_heads"),
        "v_proj": column_parallel("kv_heads"), "o_proj": row_parallel("q_heads"),
        "gate_proj": column_parallel("intermediate"), "up_proj": column_parallel("intermediate"),
        "down_proj": row_parallel("intermediate"),
    }
    expert_tp_plan: ClassVar[Mapping[str, TPSplit]] = {}  # no experts (MoE models: engine/models/moe.py)
    checkpoint_prefix: ClassVar[str] = "model."
    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer  # one decoder layer (sized on the meta device to plan offload)
    # Where a layer's attention weights (and a calibrated fp8 KV scale pair) sit in the checkpoint, by layer index.
    attention_checkpoint_prefix: ClassVar[str] = "model.layers.{}.self_attn."
    top_level_modules: ClassVar[tuple[str, ...]] = ("lm_head",)
    checkpoint_renames: ClassVar[Mapping[str, str]] = {}  # module names the checkpoint spells otherwise
    # transformers' GGUF names for the Llama family (llama.cpp's `blk.N.*`)
    gguf_tensor_names: ClassVar[Mapping[str, str]] = {
        "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
        "blk.{}.attn_q": "layers.{}.self_attn.q_proj", "blk.{}.attn_k": "layers.{}.self_attn.k_proj",
        "blk.{}.attn_v": "layers.{}.self_attn.v_proj", "blk.{}.attn_output": "layers.{}.self_attn.o_proj",
        "blk.{}.ffn_gate": "layers.{}.mlp.gate_proj", "blk.{}.ffn_up": "layers.{}.mlp.up_proj",
        "blk.{}.ffn_down": "layers.{}.mlp.down_proj", "blk.{}.attn_norm": "layers.{}.input_layernorm",
        "blk.{}.ffn_norm": "layers.{}.post_attention_layernorm", "blk.{}.attn_q_norm": "layers.{}.self_attn.q_norm",
        "blk.{}.attn_k_norm": "layers.{}.self_attn.k_norm",
    }
    gguf_permuted_heads: ClassVar[Mapping[str, str]] = {"q_proj": "num_heads", "k_proj": "num_kv_heads"}

    def __init__(self, arch: ModelArch, hf_config: Any, backend: AttentionBackend, max_positions: int,
                 fused_ops: bool = False, shard: RankShard | None = None, group: Collectives | None = None,
                 host_layers: int = 0, stage: PipelineStage | None = None) -> None:
        """`host_layers`: the first layers are built on the meta device (no memory), for a `LayerWeightStream`
        (engine/runner/weight_offload.py) to give them host memory before the weights are loaded.

        `stage` (pipeline parallelism, engine/parallel/stages.py): what this stage does not run (other stages'
        layers, the embedding off the first stage, the norm and head off the last) is built on the meta device and
        never loaded, so parameter names and order stay the full model's (dummy weights draw the same values)."""
        super().__init__()
        self.arch = arch
        self.shard = shard or RankShard.full(arch)
        self.stage = stage or PipelineStage.whole(arch.num_layers)
        self.group = group if self.shard.size > 1 else None
        if self.shard.size > 1 and group is None:
            raise ValueError("a tensor-parallel shard needs its process group")
        vocab_rows = self.shard.vocab_rows
        last, embeds = self.stage.is_last, self.stage.is_first or (self.stage.is_last and arch.tie_word_embeddings)
        with _meta_unless(embeds):
            self.embed_tokens = nn.Embedding(vocab_rows, arch.hidden_size)
        layers = []
        for index in range(arch.num_layers):
            with _meta_unless(index >= host_layers and self.stage.holds_layer(index)):
                layers.append(self.build_layer(index, arch, backend, fused_ops))
        self.layers = nn.ModuleList(layers)
        self.weight_stream: LayerWeightStream | None = None  # set when the first layers are offloaded
        with _meta_unless(last):
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused_ops)
        self.rotary = RotaryEmbedding(hf_config, arch.head_dim, max_positions, fused_ops)
        with _meta_unless(last):
            self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, vocab_rows, bias=False)
        self.cpu_logits_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.small_gemm_mode = SmallGemmMode.from_env()
        self.small_gemm = fused_ops and self.small_gemm_mode.enabled

    def build_layer(self, index: int, arch: ModelArch, backend: AttentionBackend, fused_ops: bool) -> nn.Module:
        """Decoder layer `index` (an MoE model picks each layer's MLP block here)."""
        return self.layer_class(arch, backend, fused_ops, self.shard, self.group)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: object, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """The final normed hidden states [T, H]. A pipeline stage runs its own layers only (`kv_caches` holds
        theirs): after the first it starts from `intermediate`, the previous stage's [2, T, H] (hidden states,
        residual); before the last it returns its own in that form. A later stage given no `intermediate` runs on
        zeros: the memory profile and the kernel warm-up need the shapes, not the values."""
        x, residual = self._stage_input(input_ids, intermediate)
        stream = self.weight_stream
        offloaded = 0 if stream is None else stream.num_layers
        if stream is not None:
            stream.start()  # the first offloaded layers' weights start landing in the staging buffers
        layers = self.layers[self.stage.start : self.stage.end]
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True), start=self.stage.start):
            if index < offloaded:
                stream.before_layer(index)  # type: ignore[union-attr]
            x, residual = layer(positions, x, residual, self.rotary, kv_cache, meta)
            if index < offloaded:
                stream.after_layer(index)  # type: ignore[union-attr]
        if stream is not None:
            stream.finish()
        if not self.stage.is_last:
            return torch.stack((x, residual))  # type: ignore[arg-type]  # one buffer: one send to the next stage
        return self.norm.add_norm(x, residual)[0]

    def _stage_input(self, input_ids: torch.Tensor, intermediate: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.stage.is_first:
            return self._embed(input_ids), None
        if intermediate is None:
            dtype = self.layers[self.stage.start].input_layernorm.weight.dtype
            zeros = torch.zeros(len(input_ids), self.arch.hidden_size, dtype=dtype, device=input_ids.device)
            return zeros, zeros.clone()
        return intermediate[0], intermediate[1]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.embed_tokens(input_ids)
        start, end = self.shard.vocab
        inside = (input_ids >= start) & (input_ids < end)
        x = self.embed_tokens((input_ids - start).clamp_(0, end - start - 1))
        return self.group.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits; `out` (float32 [rows, vocab]) receives them instead of a new tensor (the decode
        graphs share one buffer across batch sizes)."""
        if self.group is not None:  # this rank's vocabulary rows, then all ranks' joined
            local = self._local_logits(hidden)
            full = self.group.all_gather_last_dim(local, self.shard.vocab_padded)[:, : self.arch.vocab_size]
            return full if out is None else out.copy_(full)
        return self._local_logits(hidden, out)

    def _local_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.shard.vocab_rows
        if self.cpu_logits_head is not None:  # oneDNN-packed copy on the CPU path (engine/runner/cpu_linear.py)
            logits = self.cpu_logits_head(hidden)
        elif self.small_gemm and uses_small_gemm(hidden):  # float32 straight from the GEMM's accumulator
            return small_gemm(hidden, self._head_weight(), impl=self._head_impl(), gemv=self.small_gemm_mode.gemv,
                              out=out if out is not None else torch.empty(
                                  hidden.shape[0], rows, dtype=torch.float32, device=hidden.device))[0]
        else:
            logits = F.linear(hidden, self._head_weight())
        return logits.float() if out is None else out.copy_(logits)

    def compute_logits_argmax(self, hidden: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`compute_logits` into `out` and the greedy ids (the first index of each row's max) of those logits;
        on the small-batch path the argmax is reduced inside the GEMM and never re-reads the logits."""
        if self.small_gemm and self.cpu_logits_head is None and uses_small_gemm(hidden) and self.group is None:
            logits, _, tokens = small_gemm(hidden, self._head_weight(), out=out, argmax=True,
                                           impl=self._head_impl(), gemv=self.small_gemm_mode.gemv)
            return logits, tokens  # type: ignore[return-value]
        logits = self.compute_logits(hidden, out=out)
        return logits, logits.argmax(dim=-1)

    def _head_impl(self) -> str:
        return "gemv" if self.small_gemm_mode.impl == "gemv" and prefers_gemv_head(self.arch.hidden_size) else "dot"

    def _head_weight(self) -> torch.Tensor:
        return self.head_module().weight

    def head_module(self) -> nn.Module:
        """The module whose weight computes the logits: lm_head, or the embedding when they are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights, stacking the packed ones (q|k|v, gate|up); every parameter this rank holds (not
        on the meta device) must be covered."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.is_meta:
                    continue
                parts = [state[key] for key in checkpoint_keys(type(self), name)]
                tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
                if param.shape != tensor.shape:
                    raise ValueError(f"shape mismatch for {name}: {tuple(tensor.shape)} vs {tuple(param.shape)}")
                param.copy_(tensor)

    def prepare_fused_weights(self) -> None:
        """After loading, on the fused (CUDA) path: lay weights out as the fused kernels read them. A dense
        model reads its weights as loaded."""

    def dummy_seed(self, seed: int, index: int, name: str) -> int:
        """The generator seed of the `index`-th parameter `name` in dummy weights (the sharded draw uses it too)."""
        return seed * 1000 + index

    def init_dummy_weights(self, seed: int, device: torch.device | None = None) -> None:
        """Random weights with sane scales (values do not change speed; outputs stay finite). `device`: where the
        values are drawn (default: each parameter's own), so offloaded layers, held in host memory, get the same
        values as resident ones drawn on the GPU."""
        with torch.no_grad():
            for index, (name, param) in enumerate(self.named_parameters()):
                if param.is_meta:  # another pipeline stage's (the index still counts: the same values there)
                    continue
                where = param.device if device is None else device
                gen = torch.Generator(device=where).manual_seed(self.dummy_seed(seed, index, name))
                if is_norm_weight(name):
                    param.fill_(1.0)
                elif where == param.device:
                    param.normal_(0.0, 0.02, generator=gen)
                else:
                    param.copy_(torch.empty(param.shape, dtype=param.dtype, device=where).normal_(
                        0.0, 0.02, generator=gen))
