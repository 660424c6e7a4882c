"""The model runner and what it drives on the device: attention backends, sampling, CUDA graphs, offload."""
