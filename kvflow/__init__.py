"""kvflow: a disaggregated prefill/decode LLM serving cluster with vLLM's API."""

from engine.errors import InvalidRequest
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from kvflow.llm import LLM

__all__ = ["LLM", "CompletionOutput", "InvalidRequest", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
