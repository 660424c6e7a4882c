"""Building the compiled CPU kernels (kernels/cpu/*.cpp) with torch's C++ extension loader.

Invariants:
* every kernel builds under the kvflow cache (KVFLOW_CACHE, else ~/.cache/kvflow), in a directory named for what it
  was built from (`build_key`): the torch version and include paths (so each venv has its own build), the
  interpreter, the compiler and its flags, the CPU's instruction set (`-march=native`) and the sources' hash. Two
  checkouts or venvs never build over each other, and nothing rebuilds unless one of those changed;
* a finished build is marked (`BUILT_MARK`) and then imported directly, without torch's loader: torch would rebuild a
  library whose source path changed, which is every other checkout of the same source;
* one build at a time per directory, under an flock of ours (`build_locked`), so a builder killed mid-way never
  blocks the next one;
* a kernel that cannot be built here, or any kernel while KVFLOW_DISABLE_CPU_KERNELS=1, loads as None (logged):
  callers keep the torch path then.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "cpu"
DISABLE_ENV = "KVFLOW_DISABLE_CPU_KERNELS"
BUILT_MARK = "kvflow.built"
# Bit-exact kernels: no -ffast-math and no FMA contraction, so every product is rounded before its sum, as torch
# rounds it.
EXACT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
FAST_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")


@dataclass(frozen=True)
class CpuKernel:
    """One compiled CPU kernel: the extension module's name, its one source file and its compiler flags."""

    name: str
    source: Path
    what: str
    cflags: tuple[str, ...] = EXACT_CFLAGS


DECODE_ATTENTION = CpuKernel("kvflow_cpu_paged_attention", SOURCES / "paged_decode_attention.cpp", "paged-attention",
                             FAST_CFLAGS)
ROTARY_KV_WRITE = CpuKernel("kvflow_cpu_rotary_kv_write", SOURCES / "rotary_kv_write.cpp", "rotary + KV-write")
PREFILL_ATTENTION = CpuKernel("kvflow_cpu_prefill_attention", SOURCES / "prefill_attention.cpp", "prefill-attention")
QUANT_GEMM = CpuKernel("kvflow_cpu_quant_gemm", SOURCES / "quant_gemm.cpp", "quantized-GEMM")
CPU_KERNELS = (DECODE_ATTENTION, ROTARY_KV_WRITE, PREFILL_ATTENTION, QUANT_GEMM)


def cache_root() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE", Path.home() / ".cache" / "kvflow")) / "torch_extensions"


def kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV) == "1"


@functools.cache
def compiler_identity() -> str:
    """The C++ compiler torch will call (CXX, else c++) and its version line: a compiler upgrade rebuilds."""
    compiler = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{compiler} {version.splitlines()[0] if version else '?'}"


@functools.cache
def instruction_set() -> str:
    """What `-march=native` compiles for: the CPU's flags line, so a cache shared by unlike machines (a volume in a
    cluster) never hands one an unsupported instruction."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_inputs(kernel: CpuKernel) -> dict[str, Any]:
    """Everything a build depends on; its hash names the build directory."""
    from torch.utils.cpp_extension import include_paths

    sources = [kernel.source, *sorted(kernel.source.parent.glob("*.h"))]
    return {"kernel": kernel.name, "torch": torch.__version__, "include_paths": include_paths(),
            "python": sys.executable, "python_version": sys.version, "compiler": compiler_identity(),
            "cflags": list(kernel.cflags), "instruction_set": instruction_set(),
            "sources": hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()}


def build_key(kernel: CpuKernel) -> str:
    return hashlib.sha256(json.dumps(build_inputs(kernel), sort_keys=True).encode()).hexdigest()[:16]


def kernel_dir(kernel: CpuKernel) -> Path:
    return cache_root() / f"{kernel.source.stem}-{build_key(kernel)}"


def is_built(kernel: CpuKernel) -> bool:
    directory = kernel_dir(kernel)
    return (directory / BUILT_MARK).exists() and (directory / f"{kernel.name}.so").exists()


def import_built(kernel: CpuKernel, directory: Path) -> Any:
    """The finished build's module, imported as torch's loader imports it (torch is already imported)."""
    spec = importlib.util.spec_from_file_location(kernel.name, directory / f"{kernel.name}.so")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {directory / kernel.name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_locked(kernel: CpuKernel, directory: Path) -> Any:
    """Build (or find built by another process meanwhile) under an flock of ours on the directory.

    torch guards a build with a plain `lock` file and waits forever while one exists, so a process killed
    mid-build (a stopped CI run, a Ctrl-C) would hang every later build there. An flock is dropped by the
    kernel when its holder dies: whoever holds ours is the only kvflow builder, so a `lock` file it finds is
    a dead builder's and is removed."""
    import fcntl

    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvflow.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            if is_built(kernel):
                return import_built(kernel, directory)
            (directory / "lock").unlink(missing_ok=True)
            logger.info("compiling the CPU %s kernel into %s (first run here, about a minute)", kernel.what,
                        directory)
            started = time.monotonic()
            module = load(name=kernel.name, sources=[str(kernel.source)], build_directory=str(directory),
                          extra_cflags=list(kernel.cflags), extra_ldflags=["-fopenmp"], verbose=False)
            (directory / BUILT_MARK).write_text(json.dumps(build_inputs(kernel), indent=1) + "\n")
            logger.info("built the CPU %s kernel in %.0f s", kernel.what, time.monotonic() - started)
            return module
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load_kernel(kernel: CpuKernel) -> Any | None:
    """The kernel's module, built here on first use; None (logged) when it cannot be built or kernels are off."""
    if kernels_disabled():
        return None
    try:
        directory = kernel_dir(kernel)
        return import_built(kernel, directory) if is_built(kernel) else build_locked(kernel, directory)
    except Exception as exc:  # no compiler / headers: the torch path still works, only slower
        logger.warning("CPU %s kernel unavailable (%s); using the torch path", kernel.what, exc)
        return None


def kernel_loader(kernel: CpuKernel) -> Callable[[], Any | None]:
    """The loader of one kernel: it builds on its first call and returns that outcome (the module, or None) from
    then on, so a failed build is tried and logged once per process."""
    return functools.cache(functools.partial(load_kernel, kernel))


def _build_in_child(kernel: CpuKernel) -> tuple[bool, float]:
    started = time.monotonic()
    return load_kernel(kernel) is not None, time.monotonic() - started


def build_all(echo: Callable[[str], None] = print) -> bool:
    """Build every CPU kernel not built yet, in parallel where the cores allow, saying what it does and how long
    each took. True when every kernel is available afterwards (or kernels are disabled on purpose)."""
    if kernels_disabled():
        return True
    missing = [kernel for kernel in CPU_KERNELS if not is_built(kernel)]
    if not missing:
        return True
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        echo("no C++ compiler: the CPU kernels are not built (the torch path runs, slower)")
        return False
    echo(f"compiling CPU kernels (first run, ~1-2 min): {', '.join(kernel.what for kernel in missing)}")
    started = time.monotonic()
    workers = max(1, min(len(missing), os.cpu_count() or 1))
    # Separate processes: torch's loader is not made for concurrent builds in one process.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        outcomes = list(pool.map(_build_in_child, missing))
    for kernel, (built, seconds) in zip(missing, outcomes, strict=True):
        echo(f"  {kernel.what}: {'built' if built else 'NOT built (see the log; the torch path runs)'} "
             f"in {seconds:.0f} s")
    echo(f"CPU kernels ready in {time.monotonic() - started:.0f} s, cached under {cache_root()}")
    return all(built for built, _ in outcomes)


def print_build_outcome(load: Callable[[], Any | None]) -> None:
    """`python -m kernels.<kernel module>`: build one kernel now and say whether it built."""
    logging.basicConfig(level=logging.INFO)
    print("built" if load() is not None else "not built")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    build_all()  # a kernel that did not build is said above; the engine runs its torch path then
