"""Dummy AWQ / GPTQ weights (`load_format="dummy"`, `quantization="awq"` / `"gptq"`, engine/quant/dummy_int4.py):
a preset runs the int4 layers without a checkpoint, deterministically, with the dense dummy weights' spread; and
the same codes written as an AWQ / GPTQ checkpoint load into the same model (same weights, same greedy ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.registry import model_class
from engine.models.weight_map import checkpoint_keys, decoder_linear_paths
from engine.quant.dummy_int4 import dummy_state
from engine.quant.group_quant import dequantize, unpack_int4
from engine.quant.quant_layers import QuantLinear
from tests.helpers.oracle import greedy_outputs

PROMPTS = ([5, 17, 300, 42], [7] * 20, list(range(100, 140)))


def _engine(model: str, **kwargs: object) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=256,
                                **kwargs).create_engine_config())  # type: ignore[arg-type]


def _greedy(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and their logprobs for PROMPTS."""
    return [(o.token_ids, [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)])
            for o in greedy_outputs(engine, PROMPTS)]


def _quant_linears(engine: LLMEngine) -> dict[str, QuantLinear]:
    return {name: m for name, m in engine.runner.model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_int4_runs_deterministically_with_sane_weights(method: str) -> None:
    engine = _engine("tiny-llama", load_format="dummy", quantization=method)
    assert engine.config.model.quantization == method
    linears = _quant_linears(engine)
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer: every decoder linear is int4
    for name, linear in linears.items():
        w = linear.quant_weight()
        assert (w.bits, w.kind, w.group_size) == (4, "zero", 64), name  # 128 does not divide tiny's width 64
        assert w.zeros is not None and int(w.zeros.min()) >= 7 and int(w.zeros.max()) <= 9
        codes = unpack_int4(w.qweight)
        assert int(codes.min()) == 0 and int(codes.max()) == 15
        std = float(dequantize(w).std())
        assert 0.015 < std < 0.026, (name, std)  # the dense dummy weights' 0.02
    first = _greedy(engine)
    assert all(torch.isfinite(torch.tensor(lp)).all() for _, lp in first)
    assert _greedy(_engine("tiny-llama", load_format="dummy", quantization=method)) == first
    other = _engine("tiny-llama", load_format="dummy", quantization=method, seed=1)
    qkv = "layers.0.self_attn.qkv_proj"
    assert not torch.equal(_quant_linears(other)[qkv].qweight, linears[qkv].qweight)


def _write_checkpoint(tmp: Path, reference: LLMEngine, method: str, group: int) -> Path:
    """An AWQ / GPTQ checkpoint of the dummy model: the dense dummy tensors and `dummy_state`'s packed codes,
    drawn from a freshly built model of the same preset and seed."""
    config = reference.config.model
    model = model_class(config.arch.architecture)(config.arch, config.hf_config, reference.runner.attn_backend,
                                                  config.max_model_len)
    model.init_dummy_weights(config.seed)
    linears = tuple(f"{p}." for p in decoder_linear_paths(model))
    state = {}
    for name, param in model.named_parameters():
        if not name.startswith(linears):
            (key,) = checkpoint_keys(type(model), name)
            state[key] = param.detach().clone()
    state |= dummy_state(model, method, group, config.seed)
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc |= {"zero_point": True, "version": "gemm"} if method == "awq" else {"desc_act": False, "sym": False}
    path = tmp / method
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config.hf_config.to_dict(), "quantization_config": qc}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_int4_equals_checkpoint_of_the_same_codes(tmp_path: Path, method: str) -> None:
    dummy = _engine("tiny-llama", load_format="dummy", quantization=method)
    loaded = _engine(str(_write_checkpoint(tmp_path, dummy, method, group=64)))
    assert loaded.config.model.quantization == method
    ours, theirs = _quant_linears(dummy), _quant_linears(loaded)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(dequantize(ours[name].quant_weight()), dequantize(theirs[name].quant_weight())), name
    assert _greedy(dummy) == _greedy(loaded)


def test_dummy_int4_group_size_from_a_config_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "cfg"
    path.mkdir()
    cfg = _engine("tiny-llama", load_format="dummy").config.model.hf_config.to_dict()
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    engine = _engine(str(path), load_format="dummy")  # a 4-bit config without weights: drawn at its group size
    assert {m.group_size for m in _quant_linears(engine).values()} == {32}
    with pytest.raises(ValueError, match="load_format='dummy'"):  # a dense checkpoint has no int4 codes to load
        _write_dense_and_load(tmp_path, cfg)
    for method in ("awq", "gguf"):  # the experts run unquantized: refused, naming the argument
        with pytest.raises(ValueError, match=f"quantization='{method}' with an MoE model"):
            EngineArgs(model="tiny-qwen3-moe", load_format="dummy", quantization=method).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineArgs(model="tiny-llama", load_format="dummy", quantization="awq",
                   tensor_parallel_size=2).create_engine_config()


def _write_dense_and_load(tmp: Path, cfg: dict) -> None:
    path = tmp / "dense"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    EngineArgs(model=str(path), device="cpu", quantization="awq").create_engine_config()
