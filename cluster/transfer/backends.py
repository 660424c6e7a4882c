"""The KV transfer backends' names: the `--kv-transfer-backend` choices and the wire enum of each backend.

Light on purpose (protos only): the CLI registers its flags from here without importing torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from protos.kvflow.v1 import kvflow_pb2 as pb

# `--kv-transfer-backend`: "nccl" is the torch.distributed link (gloo between CPU workers), "auto" the link between
# GPU workers and gRPC bytes otherwise (cluster/transfer/registry.py).
KV_TRANSFER_BACKENDS = ("auto", "nccl", "grpc")
# How a request's blocks travel, as the wire names it; an unset enum is the gRPC backend.
BACKEND_NAMES: Mapping[int, str] = MappingProxyType({
    pb.KV_TRANSFER_BACKEND_UNSPECIFIED: "grpc", pb.KV_TRANSFER_BACKEND_GRPC: "grpc",
    pb.KV_TRANSFER_BACKEND_NCCL: "nccl", pb.KV_TRANSFER_BACKEND_GLOO: "gloo"})
BACKEND_ENUMS: Mapping[str, int] = MappingProxyType({
    "grpc": pb.KV_TRANSFER_BACKEND_GRPC, "nccl": pb.KV_TRANSFER_BACKEND_NCCL, "gloo": pb.KV_TRANSFER_BACKEND_GLOO})
