"""The NCCL settings every kvflow process that opens an NCCL communicator runs with: the tensor-parallel group
(engine/parallel/group.py), its child ranks (executor.py) and the KV links (cluster/transfer/link/).

They are defaults: a value already in the environment (the operator's) wins. They must be in the environment
before the first communicator is created, since NCCL and torch read them then.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType

NCCL_ENV_DEFAULTS: Mapping[str, str] = MappingProxyType({
    # NVLink multicast (NVLS) serves collectives, never point-to-point, and is off limits on shared hosts.
    "NCCL_NVLS_ENABLE": "0",
    # A timed-out NCCL operation must abort its communicator and raise, not wait forever nor kill the process
    # (torch's default tears it down).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
})


def set_nccl_env_defaults(env: MutableMapping[str, str] | None = None) -> None:
    """Fill in the NCCL defaults `env` (this process's environment unless given) does not set yet."""
    target = os.environ if env is None else env
    for name, value in NCCL_ENV_DEFAULTS.items():
        target.setdefault(name, value)
