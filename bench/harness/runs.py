"""Engines driven to completion and their outputs compared: the loops every scenario that steps an `LLMEngine`,
times `LLM.generate` or runs `kvflow bench throughput` would otherwise write again.

Invariants: nothing here changes an engine's configuration; timings are wall-clock seconds around the call only
(no warm-up: the scenario decides where warm-ups go)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def step_until_done(engine: Any) -> tuple[dict[str, Any], int]:
    """Step `engine` until no request is left: (finished outputs by request id, steps taken)."""
    outputs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
    return outputs, steps


def timed_generate(llm: Any, prompts: Any, params: Any) -> tuple[list[Any], float]:
    """`llm.generate(prompts, params)` and its wall-clock seconds."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return outputs, time.perf_counter() - start


def output_tokens(outputs: list[Any]) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def spec_counters(stats: Any) -> tuple[int, int, int]:
    """Speculative decoding's (drafts, draft tokens, accepted tokens) so far, from an engine's or LLM's stats."""
    return stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (over their common length), or None."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)


def bench_throughput_cli(*flags: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`kvflow bench throughput <flags>` in a fresh process (its own engine, as a user runs it): its JSON record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        subprocess.run([sys.executable, "-m", "kvflow.cli", "--log-level", "WARNING", "bench", "throughput", *flags,
                        "--output-json", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())
