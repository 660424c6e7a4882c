"""The `kvflow bench multiturn` workload and modes (kvflow/benchmarks/multiturn.py): plain Python, so that every
command's parser can register the benchmark's flags without loading the load generator."""

from __future__ import annotations

import dataclasses
import random

MODES = ("no-tier", "host-tier", "round-robin")


@dataclasses.dataclass(frozen=True)
class Workload:
    conversations: int = 64
    turns: int = 8
    system_len: int = 1024
    user_len: int = 128
    assistant_len: int = 256  # appended to the history after each turn
    output_len: int = 16  # tokens generated per turn
    max_concurrency: int = 8  # conversations in flight

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    @property
    def max_prompt_tokens(self) -> int:
        return self.system_len + self.turns * self.user_len + (self.turns - 1) * self.assistant_len


def make_conversations(workload: Workload, seed: int, vocab: int) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn (each one extends the one before)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    system = tokens(workload.system_len)
    conversations = []
    for _ in range(workload.conversations):
        history, prompts = list(system), []
        for _ in range(workload.turns):
            history += tokens(workload.user_len)
            prompts.append(list(history))
            history += tokens(workload.assistant_len)
        conversations.append(prompts)
    return conversations
