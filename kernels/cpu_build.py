"""Building the compiled CPU kernels (kernels/cpu/*.cpp) with torch's C++ extension loader.

Invariants:
* every kernel builds under the kvflow cache (KVFLOW_CACHE, else ~/.cache/kvflow), in a directory named for the
  torch version, so a torch upgrade rebuilds rather than loading a binary built against another ABI;
* one build at a time per directory, under an flock of ours (`build_locked`), so a builder killed mid-way never
  blocks the next one;
* a kernel that cannot be built here, or any kernel while KVFLOW_DISABLE_CPU_KERNELS=1, loads as None (logged):
  callers keep the torch path then.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "cpu"
DISABLE_ENV = "KVFLOW_DISABLE_CPU_KERNELS"
# Bit-exact kernels: no -ffast-math and no FMA contraction, so every product is rounded before its sum, as torch
# rounds it.
EXACT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")


def build_dir() -> Path:
    base = Path(os.environ.get("KVFLOW_CACHE", Path.home() / ".cache" / "kvflow"))
    path = base / "torch_extensions" / f"torch{torch.__version__.replace('+', '_')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV) == "1"


def build_locked(name: str, source: Path, build: Path, cflags: list[str]) -> Any:
    """torch's `load`, under an flock of ours on the build directory.

    torch guards a build with a plain `lock` file and waits forever while one exists, so a process killed
    mid-build (a stopped CI run, a Ctrl-C) would hang every later build there. An flock is dropped by the
    kernel when its holder dies: whoever holds ours is the only kvflow builder, so a `lock` file it finds is
    a dead builder's and is removed."""
    import fcntl

    from torch.utils.cpp_extension import load

    # torch rebuilds when a source or a flag changes, not a header: the headers' hash rides along as a flag.
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))).hexdigest()[:16]
    with open(build / "kvflow.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            return load(name=name, sources=[str(source)], build_directory=str(build),
                        extra_cflags=[*cflags, f"-DKVFLOW_HEADERS={headers}"], extra_ldflags=["-fopenmp"],
                        verbose=False)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load_exact_extension(name: str, source: Path, what: str) -> Any | None:
    """A CPU kernel that must equal torch's ops bit for bit (EXACT_CFLAGS), built into its own directory (one
    build.ninja per extension); None (logged) when it cannot be built here or kernels are disabled."""
    if kernels_disabled():
        return None
    try:
        build = build_dir() / source.stem
        build.mkdir(exist_ok=True)
        return build_locked(name, source, build, list(EXACT_CFLAGS))
    except Exception as exc:  # no compiler / headers
        logger.warning("CPU %s kernel unavailable (%s); using the torch path", what, exc)
        return None


def exact_kernel_loader(name: str, source_file: str, what: str) -> Callable[[], Any | None]:
    """The loader of the bit-exact kernel kernels/cpu/`source_file`: it builds on its first call and returns that
    outcome (the module, or None) from then on, so a failed build is tried and logged once per process."""
    return functools.cache(functools.partial(load_exact_extension, name, SOURCES / source_file, what))


def print_build_outcome(load: Callable[[], Any | None]) -> None:
    """`python -m kernels.<kernel module>` (the install step): build the kernel now and say whether it built."""
    logging.basicConfig(level=logging.INFO)
    print("built" if load() is not None else "not built")
