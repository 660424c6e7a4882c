"""Quantized weights and KV cache: group-wise int4/int8 weight-only linears (GGUF Q4_0/Q4_1/Q8_0, AWQ, GPTQ),
fp8 KV cache scales. Each concept lives in its own module."""
