"""glibc allocator settings for CPU inference.

Prefill activations are tens of MB; glibc serves such blocks with fresh mmaps and returns them on free, so every
layer pays page faults on first touch (measured: ~2 s of a 15 s 8k-token SmolLM2 prefill). Raising the mmap and
trim thresholds keeps freed blocks in the heap for reuse, as tcmalloc/jemalloc (vLLM's CPU advice) would.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc malloc_trim). Loading and packing the weights frees many
    mid-sized tensors (the plain fp32 linears), which glibc keeps in its heap: ~40 MB of a SmolLM2 CPU worker's RSS.
    Call it once after loading, before `keep_freed_memory_for_reuse` (which stops trimming). A no-op (False) where
    the C library is not glibc; under tcmalloc it trims glibc's own (unused) heap only."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.malloc_trim(0))
    except AttributeError:
        return False


def keep_freed_memory_for_reuse(mmap_threshold: int = 1 << 30, trim_threshold: int = 4 << 30) -> bool:
    """Process-wide; a no-op (False) where the C library is not glibc."""
    libc = _libc()
    try:
        ok = libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except AttributeError:
        return False
    if not ok:
        logger.debug("mallopt refused the thresholds")
    return ok


def return_large_blocks_to_os(mmap_threshold: int = 1 << 20, trim_threshold: int = 128 << 10) -> bool:
    """A router's setting, the opposite of an engine's: blocks from `mmap_threshold` up get their own mapping, given
    back to the OS when freed. glibc otherwise raises its threshold after the first large free (up to 32 MB) and
    keeps later blocks of that size in its heap: a few 21 MB request bodies left the router ~90 MB larger (issue 27:
    its RSS must return to within 10 % of idle). Setting the threshold turns glibc's adjustment off. The trim
    threshold goes back to glibc's default, in case an engine in the same process (`LLM` beside a router, tests)
    raised it: the heap's free top is then returned too."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except AttributeError:
        return False


TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
TCMALLOC_OFF_ENV = "KVFLOW_TCMALLOC"  # "0": CPU workers keep glibc's allocator


def tcmalloc_preload(env: dict[str, str]) -> str | None:
    """What a CPU worker's LD_PRELOAD should be set to, or None to leave `env` as it is: tcmalloc when it is
    installed (e.g. Debian's libtcmalloc-minimal4), vLLM's CPU advice too. Measured on SmolLM2 fp32 (2 cores): the
    prefill step -14 % against glibc even with the thresholds above. A preload only takes effect at process start,
    so this is for processes kvflow starts; an LD_PRELOAD already set, or KVFLOW_TCMALLOC=0, is left alone."""
    if env.get("LD_PRELOAD") or env.get(TCMALLOC_OFF_ENV) == "0" or not sys.platform.startswith("linux"):
        return None
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None
