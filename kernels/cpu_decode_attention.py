"""CPU decode attention over the paged KV cache, compiled once from kernels/cpu/paged_decode_attention.cpp.

The torch path gathers every sequence's blocks into a padded copy and reads it again; this kernel reads each
block once. It is built on first use (or by `python -m kernels.cpu_decode_attention`) into the kvflow cache dir;
if no compiler is available the engine keeps the torch path. Reference: `paged_decode_attention_ref` in
kernels/paged_decode_attention.py.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "paged_decode_attention.cpp"
DISABLE_ENV = "KVFLOW_DISABLE_CPU_KERNELS"


def _build_dir() -> Path:
    base = Path(os.environ.get("KVFLOW_CACHE", Path.home() / ".cache" / "kvflow"))
    path = base / "torch_extensions" / f"torch{torch.__version__.replace('+', '_')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


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
    """A CPU kernel that must equal torch's ops bit for bit (no -ffast-math, no FMA contraction: every product is
    rounded before its sum, as torch rounds it), built into its own directory (one build.ninja per extension);
    None (logged) when it cannot be built here or KVFLOW_DISABLE_CPU_KERNELS=1: the torch path runs then."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        build = _build_dir() / source.stem
        build.mkdir(exist_ok=True)
        return build_locked(name, source, build, ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])
    except Exception as exc:  # no compiler / headers
        logger.warning("CPU %s kernel unavailable (%s); using the torch path", what, exc)
        return None


@functools.cache
def load_extension() -> Any | None:
    """The compiled module, or None (logged once) when it cannot be built here."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        return build_locked("kvflow_cpu_paged_attention", SOURCE, _build_dir(),
                            ["-O3", "-march=native", "-fopenmp", "-ffast-math"])
    except Exception as exc:  # no compiler / headers: the torch path still works, only slower
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch path", exc)
        return None


def paged_decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU paged-attention kernel is not built")
    return extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("built" if load_extension() is not None else "not built")
