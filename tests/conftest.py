"""Triton interprets kernels on CPU only when TRITON_INTERPRET=1 is set before `import triton`, so the kernel test
modules run their kernel cases in a subprocess with it set. Each case is collected in exactly one of the two
processes (deselected, not skipped, in the other)."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    keep, drop = [], []
    for item in items:
        wrong_side = (item.get_closest_marker("triton_interpreter") is not None and not interpreting) or (
            item.get_closest_marker("outside_interpreter") is not None and interpreting)
        (drop if wrong_side else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
