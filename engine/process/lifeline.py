"""Child processes (`kvflow serve`'s workers, tensor-parallel ranks) die with their parent, even when it is killed
with SIGKILL (Linux's PR_SET_PDEATHSIG).

The child sets the death signal itself, first thing in `kvflow.cli.main` or `engine.parallel.worker`, rather than
in a `preexec_fn`: a `preexec_fn` forces `subprocess` to fork() instead of vfork(), and a fork() of the launcher, whose gRPC threads are
running by the time it restarts a worker, runs gRPC's fork handlers in the child, which then crashes (SIGSEGV or
SIGABRT in its event-engine thread) before it can exec. The launcher passes its pid, so that a child whose parent
is already gone by then stops at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

LIFELINE_ENV = "KVFLOW_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def lifeline_env() -> dict[str, str]:
    """The environment entry that asks a child started by this process to die with it."""
    return {LIFELINE_ENV: str(os.getpid())}


def die_with_parent_if_asked() -> None:
    """Child side: SIGTERM this process when the parent named in the environment dies (Linux; elsewhere a no-op).
    The entry is removed, so that this process's own children do not inherit it."""
    parent = os.environ.pop(LIFELINE_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != parent:  # the parent died before the death signal was set
        os.kill(os.getpid(), signal.SIGTERM)
