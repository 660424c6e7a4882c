"""Result records and the device facts they carry: where results go, how a record is written, how a device is
named in a record and in a file name, the timestamped progress line the long scenarios print, and a scenario's
parts run in order, each reported.

Invariants: `RESULTS` is bench/results/ of this checkout whatever the working directory; a record is written
whole (JSON, newline-terminated), its folder made first."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"


def write_json(path: Path, record: Any, indent: int = 2) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (the tail of a results file name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def gpu_name(otherwise: str = "cpu") -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else otherwise


def cpu_name() -> str:
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """This checkout's commit (`git describe --always --dirty`), or "unknown" outside a git checkout. A copy of
    the code inside another checkout (a `git archive` extracted under it) is not that checkout: "unknown"."""
    root = RESULTS.parent.parent
    top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if not top.stdout.strip() or Path(top.stdout.strip()).resolve() != root.resolve():
        return "unknown"
    done = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_parts(parts: list[str], run: Callable[[str], bool], on_error: Callable[[str], None] | None = None
              ) -> list[str]:
    """Run each part in order (`run(part)` is False where a part with a verdict failed it); a part that raises is
    reported and the next one still runs (a lease is short). The parts that failed, in order."""
    failures = []
    for part in parts:
        started = time.monotonic()
        try:
            if not run(part):
                failures.append(part)
        except Exception as exc:
            failures.append(part)
            log(f"part {part} FAILED: {type(exc).__name__}: {exc}")
            if on_error is not None:
                on_error(part)
        log(f"part {part} took {time.monotonic() - started:.0f} s")
    return failures
