"""Which quantized loader fills a freshly built model, by `ModelConfig.quantization` (and, for dummy weights,
`load_format == "dummy"`: random weights in the method's own layout)."""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig


def load_quantized(model: nn.Module, config: ModelConfig) -> None:
    if config.quantization == "gguf":
        from engine.quant.gguf_weights import load_gguf_quantized

        if config.gguf_file is None and config.load_format == "dummy":  # a GGUF of the model's shapes, written now
            from engine.quant.dummy_gguf import load_dummy_gguf

            load_dummy_gguf(model, config.hf_config.model_type, config.seed)
            return
        if config.gguf_file is None:
            raise ValueError(f"quantization='gguf' needs a GGUF model, got {config.model!r}")
        load_gguf_quantized(model, config.gguf_file)
        return
    if config.quantization == "fp8":
        from engine.models.loader import hf_state_dict
        from engine.quant.fp8_linear import load_fp8_checkpoint, quantize_model_fp8

        if config.load_format == "dummy":
            model.init_dummy_weights(config.seed)  # type: ignore[operator]
            quantize_model_fp8(model)
            return
        if config.model_path is None:
            raise ValueError(f"model {config.model!r} has no weights to load")
        state = hf_state_dict(config.model_path)
        if any(k.endswith(".weight_scale") for k in state):  # a pre-quantized fp8 checkpoint
            load_fp8_checkpoint(model, state)
        else:  # bf16 / fp16 weights, quantized per output channel now
            model.load_hf_state_dict(state)  # type: ignore[operator]
            del state
            quantize_model_fp8(model)
        return
    if config.quantization in ("awq", "gptq"):
        from engine.models.loader import hf_state_dict
        from engine.quant.awq_gptq import load_awq_gptq

        qc = getattr(config.hf_config, "quantization_config", None) or {}
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        if config.load_format == "dummy":  # random int4 codes in the checkpoint layout (engine/quant/dummy_int4.py)
            from engine.quant.dummy_int4 import load_dummy_awq_gptq

            load_dummy_awq_gptq(model, config.quantization, qc, config.seed)
            return
        if config.model_path is None:
            raise ValueError(f"model {config.model!r} has no {config.quantization} weights to load")
        load_awq_gptq(model, hf_state_dict(config.model_path), config.quantization, qc)
        return
    raise ValueError(f"unsupported quantization {config.quantization!r}")
