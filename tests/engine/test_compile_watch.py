"""The compile watch (engine/runner/compile_watch.py): counts and names each Triton compile after the warm-up,
chains the hooks installed before it and never makes Triton skip a compile."""

from __future__ import annotations

import logging

import pytest
from triton import knobs

from engine.runner.compile_watch import CompileWatch


def test_each_compile_is_counted_logged_and_passed_on(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["repr"]))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = CompileWatch()
    assert watch.install()
    variant = "paged_decode[num_warps=4](q: *bf16, seq_len: i32)"
    with caplog.at_level(logging.WARNING, logger="engine.runner.compile_watch"):
        assert knobs.runtime.jit_cache_hook(key=1, repr=variant, already_compiled=False) is None  # compile on
        assert knobs.runtime.jit_post_compile_hook(key=1, repr=variant, already_compiled=False) is None
    assert watch.compiles == 1 and seen == [variant]
    assert variant in caplog.text and "while serving" in caplog.text
