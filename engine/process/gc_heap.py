"""Keep the start-up heap out of Python's cyclic garbage collector in processes that serve one engine.

A worker holds a few hundred thousand long-lived objects once its engine is built (the model's modules and
parameters, the tokenizer, the compiled kernels' launchers, gRPC): 318k for a SmolLM2 CPU engine. Each full
(oldest generation) collection walks all of them, and it runs on whichever thread allocates at the time, the
engine's included: 199-251 ms per collection on this project's 2-core CI box
(bench/results/gc_pause_cpu_smollm2.json), a pause every running request sees in its inter-token gap.
`gc.freeze()` after start-up moves them to the permanent generation, which collections skip; vLLM's engine core
does the same after its start-up.

Only for processes that are the engine's alone (a worker's server, a tensor-parallel rank): freezing a caller's
heap (the `LLM` class in someone's script, a test process building many engines) would keep its later cyclic
garbage from ever being collected.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap(who: str) -> int:
    """Collect what start-up left behind, then freeze every surviving object; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen out of the garbage collector's full collections", who, frozen)
    return frozen
