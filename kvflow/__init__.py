"""kvflow: a disaggregated prefill/decode LLM serving cluster with vLLM's API."""

from engine.errors import InvalidRequest
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import GuidedDecodingParams, StructuredOutputsParams
from kvflow.llm import LLM

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "InvalidRequest", "Logprob", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
