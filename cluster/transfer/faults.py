"""Injected KV-transfer faults, for fault testing only (`--kv-transfer-fault-rate`, 0 by default).

With probability `rate` a transfer fails at a random point: on a decode worker the pull is cancelled after a
random delay (possibly mid-transfer, `FaultyReceiver`), on a prefill worker the Prefill stream is ended UNAVAILABLE
after its first KV. Either way the decode worker must recompute the prompt and answer correctly, and neither side
may strand blocks: what SGLang's disaggregation tests do with 5 % faults. Each process draws from its own generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

from cluster.transfer.contract import PullJob, PullResult
from cluster.transfer.protocols import FirstTokenCallback, KVReceiver
from engine.kv_layout import KVTransferError

MAX_DELAY_S = 0.05


@dataclass
class FaultInjector:
    rate: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    injected: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"--kv-transfer-fault-rate must be in [0, 1], got {self.rate}")

    def strike(self) -> bool:
        """Whether this transfer fails (counted)."""
        if self.rate and self.rng.random() < self.rate:
            self.injected += 1
            return True
        return False

    def delay_s(self) -> float:
        return self.rng.uniform(0.0, MAX_DELAY_S)


class FaultyReceiver:
    """A `KVReceiver` that cuts a share of its pulls at a random point, as a peer failure would."""

    def __init__(self, inner: KVReceiver, faults: FaultInjector) -> None:
        self.inner = inner
        self.faults = faults

    async def pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None = None
                   ) -> PullResult:
        if not self.faults.strike():
            return await self.inner.pull(address, job, on_first_token)
        pull = asyncio.ensure_future(self.inner.pull(address, job, on_first_token))
        await asyncio.wait({pull}, timeout=self.faults.delay_s())
        pull.cancel()
        with contextlib.suppress(BaseException):
            await pull
        raise KVTransferError("injected_fault", "injected KV-transfer fault (--kv-transfer-fault-rate)")

    async def close(self) -> None:
        await self.inner.close()
