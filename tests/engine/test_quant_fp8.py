"""--quantization fp8 on CPU: the quantize/dequantize math, the W8A8 layer (torch._scaled_mm, which also runs
on CPU) against its float32 reference, refusal on CPU, pre-quantized fp8 checkpoint recognition and loading, and
checkpoint quantizations kvflow cannot run refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.models.llama import CausalLM
from engine.models.loader import arch_from_hf_config, hf_state_dict
from engine.models.presets import preset_hf_config
from engine.quant.fp8_linear import (
    FP8,
    Fp8Linear,
    fp8_matmul_ref,
    load_fp8_checkpoint,
    quantize_per_channel,
    quantize_per_token,
)
from engine.runner.attention import TorchPagedAttention
from tests.helpers.oracle import tiny_hf_state, write_tiny_checkpoint


def test_quantize_math() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.linspace(0.01, 3, 48)[:, None]
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8 and scale.shape == (48,)
    assert torch.equal(scale, w.abs().amax(dim=1) / 448.0)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((48,), 448.0))  # each row's max maps to 448
    rel = ((q.float() * scale[:, None] - w).abs() / w.abs().amax(dim=1, keepdim=True)).max()
    assert rel <= 2**-4, rel  # e4m3: 3 mantissa bits
    x = torch.randn(5, 64, generator=g)
    x[2] = 0  # an all-zero token stays finite
    xq, xs = quantize_per_token(x)
    assert xs.shape == (5, 1) and torch.isfinite(xs).all() and not xq.float().isnan().any()


def test_fp8_linear_matches_reference() -> None:
    g = torch.Generator().manual_seed(1)
    dense = torch.nn.Linear(64, 32, bias=True)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(32, 64, generator=g))
        dense.bias.copy_(torch.randn(32, generator=g))
    layer = Fp8Linear.from_dense(dense)
    x = torch.randn(7, 64, generator=g)
    ref = fp8_matmul_ref(x, layer.weight, layer.weight_scale) + dense.bias
    out = layer(x)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert (out - dense(x)).norm() / dense(x).norm() < 0.05  # and close to the dense layer


def test_fp8_checkpoint_recognized_refused_on_cpu_and_loads(tmp_path: Path) -> None:
    arch = arch_from_hf_config(preset_hf_config("tiny"))
    gen = torch.Generator().manual_seed(2)
    dense = tiny_hf_state(arch, gen)
    fp8_state = dict(dense)
    for i, name in enumerate([k for k in dense if k.endswith("_proj.weight")]):
        q, scale = quantize_per_channel(dense[name])
        if i % 2:  # per-tensor scales too (one value per matrix)
            s = dense[name].abs().max() / 448.0
            q, scale = (dense[name] / s).to(FP8), s.reshape(1)
        fp8_state[name], fp8_state[name + "_scale"] = q, scale
    path = write_tiny_checkpoint(tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_state)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        EngineArgs(model=str(path), device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="does not apply"):
        EngineArgs(model=str(path), device="cpu", quantization="gguf").create_engine_config()
    model = CausalLM(arch, preset_hf_config("tiny"), TorchPagedAttention(16), 64)
    load_fp8_checkpoint(model, hf_state_dict(str(path)))
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8
    stored = torch.cat([fp8_state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight.view(torch.uint8), stored.view(torch.uint8))  # kept as stored, not requantized
    down = fp8_state["model.layers.0.mlp.down_proj.weight"].float() * \
        fp8_state["model.layers.0.mlp.down_proj.weight_scale"].reshape(-1, 1)
    layer = model.layers[0].mlp.down_proj
    assert torch.equal(layer.weight.float() * layer.weight_scale[:, None], down)
    assert torch.equal(model.embed_tokens.weight, dense["model.embed_tokens.weight"])


@pytest.mark.parametrize("config", [  # runnable AWQ / GPTQ layouts: tests/engine/test_quant_awq_gptq.py
    {"quant_method": "awq", "bits": 3, "group_size": 128, "zero_point": True, "version": "gemm"},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
    {"quant_method": "bitsandbytes"},
])
def test_other_checkpoint_quantizations_refused_with_reason(tmp_path: Path, config: dict) -> None:
    arch = arch_from_hf_config(preset_hf_config("tiny"))
    path = write_tiny_checkpoint(tmp_path / config["quant_method"], config, tiny_hf_state(arch, torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match=config["quant_method"]):
        EngineArgs(model=str(path), device="cpu").create_engine_config()


def test_fp8_refused_on_cpu_for_any_model() -> None:
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        EngineArgs(model="tiny", device="cpu", quantization="fp8").create_engine_config()
