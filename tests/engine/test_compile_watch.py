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


def test_a_real_compile_is_seen_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU machine, a kernel this process never launched goes through the hooks (this Triton calls them);
    here, without one, the chained hooks are checked above only."""
    import torch
    import triton
    import triton.language as tl

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = CompileWatch()
    assert watch.install()
    if not torch.cuda.is_available():
        return

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(8, device="cuda")
    add_one[(1,)](x, 8, BLOCK=8)
    assert watch.compiles == 1 and x.sum().item() == 8
