"""Which quantized loader fills a freshly built model, by `ModelConfig.quantization`."""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig


def load_quantized(model: nn.Module, config: ModelConfig) -> None:
    if config.quantization == "gguf":
        from engine.quant.gguf_weights import load_gguf_quantized

        if config.gguf_file is None:
            raise ValueError(f"quantization='gguf' needs a GGUF model, got {config.model!r}")
        load_gguf_quantized(model, config.gguf_file)
        return
    raise ValueError(f"unsupported quantization {config.quantization!r}")
