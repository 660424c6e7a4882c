"""--quantization gguf: GGUF Q4_0 / Q4_1 / Q8_0 weights kept quantized (engine/quant/).

The dequantization equals the gguf package's bit for bit; the compiled CPU kernel matches the torch reference;
SmolLM2 from its own Q4_1 file gives the greedy ids of the default fp32-dequantized form (or diverges only to a
token in that form's top-5) with under 0.3x the fp32 weight bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.models.loader import hf_state_dict, resolve_model, smollm2_gguf_path
from engine.models.presets import preset_hf_config
from engine.quant.gguf_weights import blocks_to_quant, read_gguf
from engine.quant.group_quant import (
    KINDS,
    QuantWeight,
    dequantize,
    fp16_bits,
    pack_int4,
    quant_matmul_ref,
    unpack_int4,
)
from engine.quant.quant_layers import module_weight_bytes, quant_matmul
from kernels.cpu_quant_gemm import load_quant_extension
from tests.helpers.oracle import PROMPTS, count_exact_else_top5


def _gguf_tensors(names: set[str]) -> list:  # noqa: ANN401
    from gguf import GGUFReader

    return [t for t in GGUFReader(str(smollm2_gguf_path())).tensors if t.name in names]


def _offsets(w: QuantWeight) -> torch.Tensor:
    return w.mins if w.mins is not None else w.zeros if w.zeros is not None else torch.empty(0, dtype=torch.uint8)


def test_dequantize_equals_gguf_package_exactly() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    ext = load_quant_extension()
    assert ext is not None, "the CPU quantized-GEMM kernel must build here (a compiler is part of the dev setup)"
    checked = set()
    for t in _gguf_tensors({"token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"}):
        rows, cols = int(t.shape[1]), int(t.shape[0])
        t_rows = 4096 if t.name == "token_embd.weight" else rows  # a slice of the embedding keeps it fast
        w = blocks_to_quant(t.tensor_type.name, t.data[:t_rows], t_rows, cols)
        expected = torch.from_numpy(np.asarray(gguf_dequantize(t.data[:t_rows], t.tensor_type))).reshape(t_rows, cols)
        assert torch.equal(dequantize(w), expected), t.name
        assert torch.equal(ext.dequantize(w.qweight, w.scales, _offsets(w), w.bits, KINDS.index(w.kind), 32),
                           expected), t.name
        checked.add(t.tensor_type.name)
    assert checked == {"Q4_1", "Q8_0"}
    # Q4_0 (SmolLM2 ships none): quantize random rows with the gguf package, then compare its dequantization.
    data = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    for qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        raw = gguf_quantize(data, qtype)
        w = blocks_to_quant(qtype.name, raw, 48, 128)
        expected = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype))).reshape(48, 128)
        assert torch.equal(dequantize(w), expected), qtype.name
        assert torch.equal(ext.dequantize(w.qweight, w.scales, _offsets(w), w.bits, KINDS.index(w.kind), 32),
                           expected), qtype.name


def test_pack_roundtrip_and_kernel_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (40, 256), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    scales = fp16_bits(torch.rand(40, 2, generator=gen) * 0.1)
    weights = [
        QuantWeight(4, "min", 128, 40, 256, pack_int4(q), scales, mins=fp16_bits(-torch.rand(40, 2, generator=gen))),
        QuantWeight(4, "zero", 128, 40, 256, pack_int4(q), scales,
                    zeros=torch.randint(0, 16, (40, 2), generator=gen, dtype=torch.uint8)),
        QuantWeight(8, "sym", 128, 40, 256, torch.randint(-127, 128, (40, 256), generator=gen, dtype=torch.int8),
                    scales),
    ]
    for w in weights:
        for m in (1, 3, 8, 20):  # the direct GEMV (<= 8 rows) and the dequantized-tile path
            x = torch.randn(m, 256, generator=gen)
            ref = x.double() @ dequantize(w).double().t()
            assert torch.allclose(quant_matmul(x, w), ref.float(), rtol=1e-4, atol=1e-4), (w.kind, m)
            assert torch.allclose(quant_matmul_ref(x, w), ref.float(), rtol=1e-4, atol=1e-4), (w.kind, m)


def test_read_gguf_equals_the_dequantized_checkpoint() -> None:
    """The native tensors (Q/K rows reordered as transformers does) dequantize to exactly the default form."""
    resolved = resolve_model("smollm2")
    dense = hf_state_dict(resolved.path)  # type: ignore[arg-type]
    native = read_gguf(smollm2_gguf_path(), resolved.arch)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.norm.weight"):
        t = native[name]
        got = dequantize(t.quant) if t.quant is not None else t.dense
        assert torch.equal(got, dense[name]), name
    assert native["model.layers.0.self_attn.q_proj.weight"].quant is not None
    assert native["model.embed_tokens.weight"].type_name == "Q8_0"


def test_quantization_flag_validation(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text(preset_hf_config("tiny").to_json_string())
    with pytest.raises(ValueError, match="needs a GGUF model"):  # a dense checkpoint (dummy presets write one)
        EngineArgs(model=str(tmp_path), quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="unsupported quantization 'int3'"):
        EngineArgs(model="tiny", quantization="int3").create_engine_config()


def test_smollm2_native_q4_1_greedy_and_bytes(tokenizer) -> None:  # noqa: ANN001
    from kvflow import LLM, SamplingParams

    prompts = [{"prompt_token_ids": tokenizer(p).input_ids} for p in PROMPTS]
    kw = dict(kv_cache_memory_bytes=64 << 20, max_model_len=512)
    oracle = LLM("smollm2", **kw)
    fp32_bytes = module_weight_bytes(oracle.llm_engine.runner.model)
    expected = oracle.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=5))
    del oracle
    native = LLM("smollm2", quantization="gguf", **kw)
    q_bytes = module_weight_bytes(native.llm_engine.runner.model)
    got = native.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert q_bytes <= 0.3 * fp32_bytes, (q_bytes, fp32_bytes)
    exact = count_exact_else_top5(expected, got)
    print(f"native Q4_1 vs fp32-dequantized: {exact}/{len(PROMPTS)} prompts exactly equal; weights "
          f"{q_bytes / 2**20:.1f} MiB vs {fp32_bytes / 2**20:.1f} MiB ({q_bytes / fp32_bytes:.3f}x)")
    assert exact >= len(PROMPTS) // 2
