"""Model code: the architecture shape (arch.py), the registry of model classes by HF architecture name
(registry.py), the weight names and tensor-parallel plan each class declares (weight_map.py), the Llama-family
decoder (llama.py), model resolution and weight loading (loader.py), and the dummy-weight presets (presets.py)."""
