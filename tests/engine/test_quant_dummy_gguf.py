"""Dummy GGUF weights (`load_format="dummy"`, `quantization="gguf"`, engine/quant/dummy_gguf.py): the file written
at load is a GGUF the gguf package reads (types, shapes, sane values), the model loaded from it holds exactly the
package's dequantization of its blocks, and the engine generates from it deterministically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.registry import model_class
from engine.quant.dummy_gguf import write_dummy_gguf
from engine.quant.gguf_weights import qk_row_permutation
from engine.quant.group_quant import dequantize
from engine.quant.quant_layers import QuantEmbedding, QuantLinear
from tests.helpers.oracle import greedy_outputs


def _engine(model: str = "tiny-llama", seed: int = 0) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, load_format="dummy", quantization="gguf", seed=seed, device="cpu",
                                kv_cache_memory_bytes=16 << 20, max_model_len=256).create_engine_config())


def _written(tmp: Path, engine: LLMEngine, linear_type: str) -> Path:
    config = engine.config.model
    model = model_class(config.arch.architecture)(config.arch, config.hf_config, engine.runner.attn_backend,
                                                  config.max_model_len)
    return write_dummy_gguf(model, tmp / f"{linear_type}.gguf", config.hf_config.model_type, config.seed,
                            linear_type)


@pytest.mark.parametrize("linear_type", ["Q4_1", "Q8_0", "Q4_0"])
def test_written_file_reads_with_the_gguf_package(tmp_path: Path, linear_type: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    engine = _engine()
    arch = engine.config.model.arch
    reader = GGUFReader(str(_written(tmp_path, engine, linear_type)))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 9 * arch.num_layers  # embedding, output norm, output; 7 linears + 2 norms a layer
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert tensors["output.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.1.attn_norm.weight"].tensor_type.name == "F32"
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type.name == linear_type
    assert [int(s) for s in q.shape] == [arch.hidden_size, arch.num_heads * arch.head_dim]  # innermost first
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"):
        w = np.array(gguf_dequantize(tensors[name].data, tensors[name].tensor_type), dtype=np.float32)
        # Q4_0's codes 0..15 around 8 leave a mean of -d/2 (about -0.002): the format's own bias
        assert abs(float(w.mean())) < 0.004 and 0.015 < float(w.std()) < 0.026, (name, w.mean(), w.std())
    assert np.array_equal(tensors["output_norm.weight"].data, np.ones(arch.hidden_size, np.float32))


def test_dummy_gguf_model_holds_the_files_blocks(tmp_path: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    engine = _engine()
    arch = engine.config.model.arch
    model = engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and (qkv.bits, qkv.kind, qkv.group_size) == (4, "min", 32)
    assert isinstance(model.layers[1].mlp.down_proj, QuantLinear)
    # the same seed writes the same file: the loaded q rows are the package's dequantization, un-permuted
    tensors = {t.name: t for t in GGUFReader(str(_written(tmp_path, engine, "Q4_1"))).tensors}
    t = tensors["blk.0.attn_q.weight"]
    rows = arch.num_heads * arch.head_dim
    want = torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
    want = want.reshape(rows, arch.hidden_size)[qk_row_permutation(rows, arch.num_heads)]
    assert torch.equal(dequantize(qkv.quant_weight())[:rows], want)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    return [out.token_ids for out in greedy_outputs(engine, [[5, 17, 300, 42], list(range(100, 140))])]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_dummy_gguf_engine_generates_deterministically(preset: str) -> None:
    first = _greedy(_engine(preset))
    assert all(len(ids) == 6 for ids in first)
    assert _greedy(_engine(preset)) == first
    other = _engine(preset, seed=1).runner.model.layers[0].mlp.down_proj
    assert not torch.equal(other.qweight, _engine(preset).runner.model.layers[0].mlp.down_proj.qweight)
