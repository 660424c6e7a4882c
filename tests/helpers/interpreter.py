"""A kernel test module's Triton-interpreter cases, run in a subprocess.

Triton interprets kernels on CPU only when TRITON_INTERPRET=1 is set before `import triton`, and setting it in
the pytest process would leak into every other test module. So each kernel test module declares one test,
`test_<what>_under_interpreter = interpreter_cases_test(__file__, ...)`, collected only outside the interpreter: it
re-runs that module's own file with the variable set, where tests/conftest.py collects the module's
`triton_interpreter` cases (and only there). It fails when any of them fails, and when fewer (or more) of them
passed than the module expects, so a case that silently stops being collected is noticed.

One subprocess serves every such module collected in this session (each start imports torch, Triton and pytest
again: ~4 s apiece on a 2-core box): the first of these tests to run re-runs all the collected modules' files at
once, and each test then judges its own module's cases from that run's JUnit report. Its time shows on that first
test in --durations."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class _Run:
    """The shared subprocess's outcome: per file, the cases that passed and the failures' reports."""

    output: str
    passed: dict[str, int] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None  # the run itself failed (timed out, crashed, no report)


# The session's runs, by the files they covered: kept in the pytest config's stash, not in a module global.
_RUNS_KEY = pytest.StashKey[dict[tuple[Path, ...], _Run]]()


def interpreter_cases_test(test_file: str, *, at_least: int, at_most: int | None = None,
                           timeout: float) -> Callable[[], None]:
    """The test that runs `test_file`'s interpreter cases: all must pass, `at_least` to `at_most` of them (no upper
    bound: None)."""
    path = Path(test_file).resolve()

    @pytest.mark.outside_interpreter
    def run_cases(request: pytest.FixtureRequest) -> None:
        selected = _selected_files(request.session)
        files = selected if path in selected else {path: timeout}
        runs = request.config.stash.setdefault(_RUNS_KEY, {})
        key = tuple(files)
        if key not in runs:
            runs[key] = _run_under_interpreter(key, sum(files.values()))
        _check_module(path, runs[key], at_least, at_most)

    run_cases.interpreter_file = path  # type: ignore[attr-defined]
    run_cases.interpreter_timeout = timeout  # type: ignore[attr-defined]
    return run_cases


def _selected_files(session: pytest.Session) -> dict[Path, float]:
    """The files (and timeouts) of every interpreter-cases test this session runs (after -k / deselection), in
    its order."""
    tests = (getattr(item, "function", None) for item in session.items)
    return {f.interpreter_file: f.interpreter_timeout for f in tests if hasattr(f, "interpreter_file")}


def _check_module(test_file: Path, run: _Run, at_least: int, at_most: int | None) -> None:
    assert run.error is None, run.error
    key = str(test_file.relative_to(REPO))
    failures = run.failures.get(key, [])
    assert not failures, "\n\n".join(failures)[-8000:]
    passed = run.passed.get(key, 0)
    assert at_least <= passed and (at_most is None or passed <= at_most), (passed, run.output[-2000:])


def _run_under_interpreter(files: tuple[Path, ...], timeout: float) -> _Run:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
               f"--junitxml={report}", *map(str, files)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return _Run("", error=f"the interpreter run of {len(files)} file(s) ran past {timeout:.0f} s: {exc}")
        output = proc.stdout[-8000:] + proc.stderr[-2000:]
        if not report.exists():
            return _Run(output, error=f"no report from the interpreter run (exit {proc.returncode}):\n{output}")
        run = _Run(output)
        for case in ET.parse(report).getroot().iter("testcase"):
            # xunit1 names the case's file; a collection error has none, only its module in classname / name
            name = case.get("file") or (case.get("classname") or case.get("name") or "").replace(".", "/") + ".py"
            bad = [child for child in case if child.tag in ("failure", "error")]
            if bad:
                run.failures.setdefault(name, []).extend(
                    f"{case.get('name')}: {child.get('message', '')}\n{child.text or ''}" for child in bad)
            elif not any(child.tag == "skipped" for child in case):
                run.passed[name] = run.passed.get(name, 0) + 1
        if proc.returncode != 0 and not run.failures:  # e.g. an internal error: every module sees it
            run.error = f"the interpreter run exited {proc.returncode} with no failed case:\n{output}"
        return run
