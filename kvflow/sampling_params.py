"""vLLM's `vllm.sampling_params` names: `from kvflow.sampling_params import SamplingParams, GuidedDecodingParams`."""

from engine.sampling_params import SamplingParams
from engine.structured.grammar import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]
