"""The CPU kernels' build cache: keyed by what a build is made from, shared by checkouts of the same source, and
loaded without torch's loader once built (which would rebuild a library whose source path changed)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_build
from kernels.cpu_build import CPU_KERNELS, QUANT_GEMM, build_key, kernel_dir, kernel_loader


def test_the_build_key_follows_flags_sources_and_the_torch_install(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    key = build_key(QUANT_GEMM)
    assert build_key(QUANT_GEMM) == key
    assert build_key(dataclasses.replace(QUANT_GEMM, cflags=(*QUANT_GEMM.cflags, "-g"))) != key
    copy = tmp_path / QUANT_GEMM.source.name
    shutil.copy(QUANT_GEMM.source, copy)
    for header in QUANT_GEMM.source.parent.glob("*.h"):
        shutil.copy(header, tmp_path / header.name)
    moved = dataclasses.replace(QUANT_GEMM, source=copy)
    assert build_key(moved) == key, "another checkout of the same source shares the build"
    copy.write_text(copy.read_text() + "\n// changed\n")
    assert build_key(moved) != key
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "include_paths", lambda *a, **k: ["/another/venv/include"])
    assert build_key(QUANT_GEMM) != key, "another venv's torch builds its own"
    assert len({kernel_dir(kernel) for kernel in CPU_KERNELS}) == len(CPU_KERNELS)


def test_a_built_kernel_loads_without_torchs_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernel_loader(QUANT_GEMM)() is not None  # built (or found built) the first time

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a kernel that was built")

    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    assert cpu_build.load_kernel(QUANT_GEMM) is not None


def test_build_all_reports_nothing_when_everything_is_built() -> None:
    lines: list[str] = []
    assert cpu_build.build_all(echo=lines.append)
    assert lines == []
    done = subprocess.run([sys.executable, "-m", "kernels.cpu_build"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
