"""Model code: the architecture shape (arch.py), the registry of model classes by HF architecture name
(registry.py), the weight names and tensor-parallel plan each class declares (weight_map.py), the Llama-family
decoder (llama.py), the sparse mixture-of-experts block and decoder (moe.py) with its Qwen3-MoE (qwen3_moe.py),
Qwen2-MoE (qwen2_moe.py) and Mixtral (mixtral.py) classes, model resolution and weight loading (loader.py), and
the dummy-weight presets (presets.py)."""
