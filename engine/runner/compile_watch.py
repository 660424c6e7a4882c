"""Triton compiles while serving: after the warm-up (engine/runner/warmup.py), every kernel variant Triton meets
for the first time in this process is logged as a warning with its specialization and compile time.

Why: a variant the warm-up missed compiles inside a user's request (a fraction of a second to seconds, on the
engine thread), and nothing else shows which one it was. The warning names the kernel and its argument
specialization, so the warm-up's batches can be extended to cover it.

Invariants:
- Installed once per process by the runner, after its warm-up; it chains whatever hooks were installed before
  and never asks Triton to skip a compile (the hooks return what the chained hook returns, None without one).
- It only reads and logs: no kernel, argument or cache changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Counts and logs the Triton compiles after `install`."""

    def __init__(self) -> None:
        self.compiles = 0
        self._started: dict[str, float] = {}

    def install(self) -> bool:
        """Hook Triton's JIT (False where this Triton has no such hooks: nothing is watched then)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        runtime.jit_cache_hook = self._chain(runtime.jit_cache_hook, self._before)
        runtime.jit_post_compile_hook = self._chain(runtime.jit_post_compile_hook, self._after)
        return True

    @staticmethod
    def _chain(previous: Callable[..., Any] | None, own: Callable[..., None]) -> Callable[..., Any]:
        def hook(**kwargs: Any) -> Any:
            own(**kwargs)
            return previous(**kwargs) if previous is not None else None
        return hook

    def _before(self, **kwargs: Any) -> None:
        self.compiles += 1
        self._started[str(kwargs.get("repr"))] = time.perf_counter()

    def _after(self, **kwargs: Any) -> None:
        variant = str(kwargs.get("repr"))
        started = self._started.pop(variant, None)
        seconds = time.perf_counter() - started if started is not None else float("nan")
        logger.warning("Triton compiled a kernel variant while serving (%.2f s; the warm-up missed it): %s",
                       seconds, variant)
