"""A kernel test module's Triton-interpreter cases, run in a subprocess.

Triton interprets kernels on CPU only when TRITON_INTERPRET=1 is set before `import triton`, and setting it in
the pytest process would leak into every other test module. So each kernel test module declares one test,
`test_<what>_under_interpreter = interpreter_cases_test(__file__, ...)`, collected only outside the interpreter: it
re-runs that module's own file with the variable set, where tests/conftest.py collects the module's
`triton_interpreter` cases (and only there). It fails when any of them fails, and when fewer (or more) of them
passed than the module expects, so a case that silently stops being collected is noticed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def interpreter_cases_test(test_file: str, *, at_least: int, at_most: int | None = None,
                           timeout: float) -> Callable[[], None]:
    """The test that runs `test_file`'s interpreter cases: all must pass, `at_least` to `at_most` of them (no upper
    bound: None)."""

    @pytest.mark.outside_interpreter
    def run_cases() -> None:
        _run_under_interpreter(Path(test_file).resolve(), at_least, at_most, timeout)

    return run_cases


def _run_under_interpreter(test_file: Path, at_least: int, at_most: int | None, timeout: float) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    count = re.search(r"\b(\d+) passed", proc.stdout)
    passed = int(count.group(1)) if count else 0
    assert at_least <= passed and (at_most is None or passed <= at_most), proc.stdout[-2000:]
