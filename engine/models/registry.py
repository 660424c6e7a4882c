"""Which model class runs which architecture: HF `architectures` names (config.json) -> model classes, as vLLM's
registry maps them.

Each model class declares its own weight names and tensor-parallel plan (engine/models/weight_map.py), so a new
architecture is its model file plus a row here. Classes are imported on first use, by module and name: the loader
asks which architectures exist without importing torch model code or kernels.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from engine.errors import ModelNotAvailable

if TYPE_CHECKING:
    from engine.models.llama import CausalLM

# HF architecture name -> (module, class)
_MODEL_CLASSES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "LlamaForCausalLM": ("engine.models.llama", "CausalLM"),  # Llama 2/3, SmolLM2
    "Qwen2ForCausalLM": ("engine.models.llama", "CausalLM"),  # Qwen2 / 2.5: q|k|v bias
    "Qwen3ForCausalLM": ("engine.models.llama", "CausalLM"),  # Qwen3: q/k norms
    "Qwen2MoeForCausalLM": ("engine.models.qwen2_moe", "Qwen2MoeForCausalLM"),  # Qwen2 + experts, a shared one
    "Qwen3MoeForCausalLM": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),  # Qwen3 + sparse experts
    "MixtralForCausalLM": ("engine.models.mixtral", "MixtralForCausalLM"),  # Llama + sparse experts
})
# HF model_type -> the architecture it runs as: the supported families, and the answer for configs that name no
# architecture (the dummy presets' `AutoConfig.for_model`)
_ARCHITECTURE_OF_MODEL_TYPE: Mapping[str, str] = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
})


def architecture_of(hf_config: Any) -> str:
    """The registered architecture an HF config runs as: the first of its `architectures` that is registered,
    else its model_type's; ModelNotAvailable for a model_type kvflow does not run."""
    model_type = getattr(hf_config, "model_type", "?")
    if model_type not in _ARCHITECTURE_OF_MODEL_TYPE:
        raise ModelNotAvailable(f"unsupported architecture {model_type!r}; supported: "
                                f"{', '.join(_ARCHITECTURE_OF_MODEL_TYPE)}")
    named = [name for name in getattr(hf_config, "architectures", None) or () if name in _MODEL_CLASSES]
    return named[0] if named else _ARCHITECTURE_OF_MODEL_TYPE[model_type]


def model_class(architecture: str) -> type[CausalLM]:
    """The class that runs `architecture` (a name `architecture_of` returned)."""
    module, name = _MODEL_CLASSES[architecture]
    return getattr(importlib.import_module(module), name)
