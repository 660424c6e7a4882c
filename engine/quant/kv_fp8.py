"""fp8 (e4m3) KV cache (`--kv-cache-dtype fp8`, alias `fp8_e4m3`): what is stored and how it is scaled.

Each K and V value is stored as e4m3(value / scale) and read back as stored x scale (kernels/fp8_kv.py). The scales
are per tensor, one for K and one for V in each layer (the attention module passes its pair to the backend):
- calibrated into the checkpoint, as llm-compressor, AutoFP8 and ModelOpt write them (`checkpoint_kv_scales`);
- else 1.0, as vLLM uses when a checkpoint carries none. Why 1.0 is often enough: e4m3 covers +-448 with 3
  mantissa bits at every magnitude from 2**-6 up, so what matters is that no value saturates; SmolLM2's K/V on
  the bench text peak far below 448 (bench/quant_cpu.py records the per-layer absolute maxima). A model whose K
  exceeds 448 needs a calibrated scale (amax / 448), or its largest values clip.

Blocks hold the same token ids either way, so prefix-cache hashes (engine/core/block_hash.py) do not change; P/D
transfer carries the e4m3 bytes as they are. The layout header says `float8_e4m3fn` and lists every layer's two
scales (`KVLayout.kv_scales`): a worker whose KV dtype or scales differ is refused as a layout mismatch, since
the same bytes would mean other values there.
"""

from __future__ import annotations

import math
from pathlib import Path

KVScales = tuple[float, float]  # (k_scale, v_scale) of one layer
DEFAULT_KV_SCALES: KVScales = (1.0, 1.0)

# Where each checkpoint format keeps a layer's scales, under the layer's attention prefix (the model class's
# `attention_checkpoint_prefix`, `model.layers.{i}.self_attn.` for the Llama family): compressed-tensors
# (llm-compressor) and AutoFP8 write k_scale / v_scale, ModelOpt k_proj.k_scale / v_proj.v_scale, and older
# AutoFP8 checkpoints one kv_scale for both.
K_SCALE_NAMES = ("k_scale", "k_proj.k_scale", "kv_scale")
V_SCALE_NAMES = ("v_scale", "v_proj.v_scale", "kv_scale")
_SCALE_LEAVES = {name.rsplit(".", 1)[-1] for name in K_SCALE_NAMES + V_SCALE_NAMES}  # the names' last parts


def checkpoint_kv_scales(model_path: str | None, num_layers: int, attention_prefix: str) -> list[KVScales] | None:
    """Each layer's calibrated (k_scale, v_scale) from the checkpoint's safetensors files, or None when it holds
    none; `attention_prefix` says where layer i's attention lives ("...{}..." formatted with i). Reads only those
    scalars. A checkpoint that scales some layers and not others, or holds a scale that
    is not one positive finite number (per-head scales, say), is refused with the tensor's name."""
    if model_path is None:
        return None
    from safetensors import safe_open

    layers_prefix = attention_prefix.split("{}", 1)[0]
    found: dict[str, float] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if key.startswith(layers_prefix) and key.rsplit(".", 1)[-1] in _SCALE_LEAVES:
                    tensor = f.get_tensor(key)
                    if tensor.numel() != 1:
                        raise ValueError(f"fp8 KV cache: {key} holds {tensor.numel()} scales; kvflow takes one "
                                         "scale per tensor (per-head KV scales are not supported)")
                    value = float(tensor.float().item())
                    if not (math.isfinite(value) and value > 0):
                        raise ValueError(f"fp8 KV cache: {key} is {value}; a scale must be a positive finite number")
                    found[key] = value
    if not found:
        return None
    scales: list[KVScales] = []
    for i in range(num_layers):
        prefix = attention_prefix.format(i)
        pair = [next((found[prefix + n] for n in names if prefix + n in found), None)
                for names in (K_SCALE_NAMES, V_SCALE_NAMES)]
        if pair[0] is None or pair[1] is None:
            names = K_SCALE_NAMES if pair[0] is None else V_SCALE_NAMES
            raise ValueError(f"fp8 KV cache: the checkpoint calibrates some layers' KV scales, but layer {i} has "
                             f"none of {', '.join(prefix + n for n in names)}")
        scales.append((pair[0], pair[1]))
    return scales
