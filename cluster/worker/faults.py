"""Injected KV-transfer faults, for fault testing only (`--kv-transfer-fault-rate`, 0 by default).

With probability `rate` a transfer fails at a random point: on a decode worker the pull is cancelled after a
random delay (possibly mid-transfer), on a prefill worker the Prefill stream is ended UNAVAILABLE after its first
KV. Either way the decode worker must recompute the prompt and answer correctly, and neither side may strand
blocks: what SGLang's disaggregation tests do with 5 % faults. Each process draws from its own generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
