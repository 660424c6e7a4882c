"""kvflow: a disaggregated prefill/decode LLM serving cluster with vLLM's API.

This package is the roof: the CLI, the launcher, `LLM`, the gRPC client SDK and `kvflow bench`. Its names load
on first use (PEP 562), so `from kvflow import LLM` works while a router process that only runs `kvflow.cli`
never imports the engine's runner, models or kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.errors import InvalidRequest
    from engine.outputs import CompletionOutput, Logprob, RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.structured.grammar import GuidedDecodingParams, StructuredOutputsParams
    from kvflow.llm import LLM

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "kvflow.llm",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "InvalidRequest": "engine.errors",
    "SamplingParams": "engine.sampling_params",
    "GuidedDecodingParams": "engine.structured.grammar",
    "StructuredOutputsParams": "engine.structured.grammar",
}

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "InvalidRequest", "Logprob", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
    # Before the engine's first `import torch` loads libgomp (engine/process/openmp.py).
    from engine.process.openmp import apply_openmp_policy

    apply_openmp_policy()
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
