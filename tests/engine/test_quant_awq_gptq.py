"""AWQ / GPTQ 4-bit checkpoints: the tests build tiny ones themselves (the `tiny` preset's random weights
quantized round-to-nearest into each layout's tensor names and packing), load them, and check each fused layer's
dequantization equals a torch reference of the same quantized weights exactly, and greedy ids equal (or stay
within the top-5 of) a dense checkpoint holding those dequantized weights. Unsupported layouts are refused with
the reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.loader import arch_from_hf_config
from engine.models.presets import preset_hf_config
from engine.quant.awq_gptq import AWQ_ORDER
from engine.quant.group_quant import dequantize
from engine.quant.quant_layers import QuantLinear
from engine.sampling_params import SamplingParams

GROUP = 32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest per group of GROUP inputs: w [N, K] -> q [N, K], zeros [N, K/G], scales fp16."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-6).half()
    zero = (-lo / scale.float()).round().clamp(0, 15)
    q = (g / scale.float()[..., None]).round().add(zero[..., None]).clamp(0, 15)
    zero[0, 0] = 0  # one group with zero point 0: GPTQ stores it as 15 ((0 - 1) mod 16)
    return q.view(n, k).to(torch.uint8), zero.to(torch.uint8), scale


def reference(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() - zero.float().repeat_interleave(GROUP, 1)) * scale.float().repeat_interleave(GROUP, 1)


def _int32(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy().astype(np.int64).astype(np.uint32).view(np.int32))


def pack_awq(cols: torch.Tensor) -> torch.Tensor:
    """[R, N] values 0..15 -> int32 [R, N/8], nibble i of column c = column 8c + AWQ_ORDER[i]."""
    r, n = cols.shape
    v = cols.long().view(r, n // 8, 8)[..., list(AWQ_ORDER)]
    return _int32((v << torch.arange(0, 32, 4)).sum(-1))


def pack_gptq_rows(rows: torch.Tensor) -> torch.Tensor:
    """[K, N] -> int32 [K/8, N], nibble i of row r = row 8r + i."""
    k, n = rows.shape
    v = rows.long().view(k // 8, 8, n)
    return _int32((v << torch.arange(0, 32, 4)[None, :, None]).sum(1))


def pack_gptq_cols(cols: torch.Tensor) -> torch.Tensor:
    r, n = cols.shape
    return _int32((cols.long().view(r, n // 8, 8) << torch.arange(0, 32, 4)).sum(-1))


def build(tmp: Path, method: str, qc_extra: dict | None = None) -> tuple[Path, Path, dict]:
    """(quantized checkpoint, dense checkpoint of the same dequantized weights, references per linear)."""
    cfg = preset_hf_config("tiny")
    arch = arch_from_hf_config(cfg)
    gen = torch.Generator().manual_seed(5)
    h, q_out, kv_out, inter = arch.hidden_size, arch.num_heads * arch.head_dim, \
        arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    shapes = {"self_attn.q_proj": (q_out, h), "self_attn.k_proj": (kv_out, h), "self_attn.v_proj": (kv_out, h),
              "self_attn.o_proj": (h, q_out), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    common = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, h, generator=gen) * 0.5,
              "model.norm.weight": torch.ones(h), "lm_head.weight": torch.randn(arch.vocab_size, h, generator=gen)}
    quant, dense, refs = dict(common), dict(common), {}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            quant[p + norm + ".weight"] = dense[p + norm + ".weight"] = torch.ones(h)
        for name in LINEARS:
            q, zero, scale = rtn(torch.randn(*shapes[name], generator=gen) * 0.3)
            ref = reference(q, zero, scale)
            refs[p + name] = ref
            dense[p + name + ".weight"] = ref
            if method == "awq":
                quant[p + name + ".qweight"] = pack_awq(q.t().contiguous())
                quant[p + name + ".qzeros"] = pack_awq(zero.t().contiguous())
            else:
                quant[p + name + ".qweight"] = pack_gptq_rows(q.t().contiguous())
                stored = (zero.t().contiguous().long() - 1) & 0xF  # GPTQ's (zero - 1) mod 16
                quant[p + name + ".qzeros"] = pack_gptq_cols(stored)
                quant[p + name + ".g_idx"] = (torch.arange(shapes[name][1]) // GROUP).int()
            quant[p + name + ".scales"] = scale.t().contiguous()
    qc = {"quant_method": method, "bits": 4, "group_size": GROUP}
    qc |= {"zero_point": True, "version": "gemm"} if method == "awq" else {"desc_act": False, "sym": False}
    qc |= qc_extra or {}
    paths = []
    for sub, state, extra in ((f"{method}", quant, {"quantization_config": qc}), (f"{method}-dense", dense, {})):
        path = tmp / sub
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**cfg.to_dict(), **extra}))
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
        paths.append(path)
    return paths[0], paths[1], refs


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), device="cpu", kv_cache_memory_bytes=16 << 20,
                                max_model_len=256).create_engine_config())


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_checkpoint_loads_exactly_and_generates(tmp_path: Path, method: str) -> None:
    qpath, dpath, refs = build(tmp_path, method)
    engine = _engine(qpath)
    assert engine.config.model.quantization == method
    model = engine.runner.model
    for i, layer in enumerate(model.layers):
        qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
        assert isinstance(qkv, QuantLinear) and qkv.bits == 4 and qkv.group_size == GROUP
        want = torch.cat([refs[f"model.layers.{i}.self_attn.{p}_proj"] for p in "qkv"])
        assert torch.equal(dequantize(qkv.quant_weight()), want)
        assert torch.equal(dequantize(down.quant_weight()), refs[f"model.layers.{i}.mlp.down_proj"])
    dense = _engine(dpath)
    prompts = [[5, 17, 300, 42], [7] * 20, list(range(100, 140))]
    exact = 0
    for n, prompt in enumerate(prompts):
        for eng, params in ((engine, SamplingParams(max_tokens=8, temperature=0)),
                            (dense, SamplingParams(max_tokens=8, temperature=0, logprobs=5))):
            eng.add_request(f"r{n}", prompt, params)
        outs = {}
        for eng in (engine, dense):
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        outs[id(eng)] = out.outputs[0]
        ours, theirs = outs[id(engine)].token_ids, outs[id(dense)]
        if ours == theirs.token_ids:
            exact += 1
            continue
        k = next(j for j, (a, b) in enumerate(zip(ours, theirs.token_ids, strict=False)) if a != b)
        assert ours[k] in theirs.logprobs[k]
    assert exact >= 2


@pytest.mark.parametrize("method,extra,reason", [
    ("gptq", {"desc_act": True}, "desc_act=True"),
    ("gptq", {"bits": 8}, "bits=8"),
    ("awq", {"group_size": -1}, "group_size=-1"),
    ("awq", {"version": "gemv"}, "'gemv'"),
])
def test_unsupported_layouts_refused_with_reason(tmp_path: Path, method: str, extra: dict, reason: str) -> None:
    qpath, _, _ = build(tmp_path, method, extra)
    with pytest.raises(ValueError, match=reason):
        EngineArgs(model=str(qpath), device="cpu").create_engine_config()
