"""Triton interprets kernels on CPU only when TRITON_INTERPRET=1 is set before `import triton`, so the kernel test
modules run their kernel cases in a subprocess with it set. Each case is collected in exactly one of the two
processes (deselected, not skipped, in the other).

A plain `pytest` run (unlike `python -m pytest`) does not put the checkout on sys.path: this conftest, loaded
before any test module, does, so every module imports `kernels`, `engine`, ... and `tests.helpers` the same way.

The P/D worker tests share the SmolLM2 prompt sets and the unified engine's reference outputs (session fixtures);
the OpenAI-front tests share one real `kvflow serve` (`server`, tests/helpers/serve.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    keep, drop = [], []
    for item in items:
        wrong_side = (item.get_closest_marker("triton_interpreter") is not None and not interpreting) or (
            item.get_closest_marker("outside_interpreter") is not None and interpreting)
        (drop if wrong_side else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # The test that stops the shared `kvflow serve` runs after every other test that may use it, whatever the
    # folders' order (tests/deploy/ sorts before tests/router/).
    items[:] = sorted(keep, key=lambda item: item.get_closest_marker("stops_shared_server") is not None)


@pytest.fixture(scope="session")
def tokenizer():  # noqa: ANN201
    from tests.helpers.oracle import hf_tokenizer  # transformers only where used

    return hf_tokenizer()


@pytest.fixture(scope="session")
def prompt_sets(tokenizer) -> dict[str, list[list[int]]]:  # noqa: ANN001
    from tests.helpers.oracle import PROMPTS

    short = [tokenizer(p).input_ids for p in PROMPTS]
    text = " ".join(PROMPTS) + " "
    long = [tokenizer(f"Document {i}. " + text * reps).input_ids for i, reps in ((1, 4), (2, 14))]
    return {"short": short, "long": long}


@pytest.fixture(scope="session")
def unified(prompt_sets: dict[str, list[list[int]]]) -> dict[tuple[int, ...], list[int]]:
    """Reference greedy outputs of the unified engine (default 8192-token budget: one prefill chunk)."""
    from kvflow import LLM, SamplingParams
    from tests.helpers.pd import KV_BYTES, MAX_MODEL_LEN, MAX_TOKENS

    llm = LLM("smollm2", kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN)
    prompts = [*prompt_sets["short"], *prompt_sets["long"]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    del llm
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.helpers.serve import start_server

    yield from start_server(tmp_path_factory.mktemp("serve") / "serve.log")
