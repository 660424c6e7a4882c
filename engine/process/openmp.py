"""libgomp's spin policy for every CPU entry point (`kvflow serve`'s workers, `LLM`, `kvflow generate`/`bench`).

After each parallel region libgomp's threads spin 300,000 times before they sleep, which is what a process alone on
its cores wants. Beside any other busy process (a second worker, a neighbour's job) the spinning threads take the
cores from the thread that has work. Measured (bench/results/cpu_openmp_policy*.json: SmolLM2-135M shapes, offline,
8 x 64/32, two pinned cores, quiet or beside one busy process on one of them), out tok/s quiet / loaded:
  GOMP_SPINCOUNT 300,000 (libgomp's default) 99.7 / 4.4; 100,000 90.8 / 7.3; 30,000 94.6 / 17.7;
  10,000 89.4 / 34.2; 3,000 89.6 / 45.5; 1,000 91.2 / 50.1.
No count wins both: 1,000 (libgomp's own choice when threads outnumber cores) gives up 9 % of the quiet figure for
11x the loaded one, and keeps loaded within 2x of quiet. So every CPU entry point uses it by default.

Invariants:
* the caller's GOMP_SPINCOUNT or OMP_WAIT_POLICY always wins;
* libgomp reads its settings once, when torch loads it: `apply_openmp_policy` must run before `import torch`, and says
  (False) when it came too late.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

SHARED_CORES_GOMP_SPINCOUNT = "1000"


def openmp_env(env: MutableMapping[str, str]) -> dict[str, str]:
    """What to add to `env` for a CPU process: nothing where the caller chose a spin or wait policy."""
    if env.get("GOMP_SPINCOUNT") or env.get("OMP_WAIT_POLICY"):
        return {}
    return {"GOMP_SPINCOUNT": SHARED_CORES_GOMP_SPINCOUNT}


def libgomp_loaded() -> bool:
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: no libgomp to tune
        return False


def apply_openmp_policy(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set this process's spin policy if libgomp is not loaded yet; False when it already is (then the policy the
    process started with stays)."""
    environ = os.environ if environ is None else environ
    if libgomp_loaded():
        return bool(environ.get("GOMP_SPINCOUNT") or environ.get("OMP_WAIT_POLICY"))
    environ.update(openmp_env(environ))
    return True
