"""The KV transfer backends' names: the `--kv-transfer-backend` choices.

Light on purpose (no imports): the CLI registers its flags from here without importing torch.distributed.
"""

from __future__ import annotations

# `--kv-transfer-backend`: "nccl" is the torch.distributed link (gloo between CPU workers), "auto" the link between
# GPU workers and gRPC bytes otherwise.
KV_TRANSFER_BACKENDS = ("auto", "nccl", "grpc")
