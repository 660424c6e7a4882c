"""Where a parallel rank is stuck: a report, once per overdue task, before anything times out.

A rank that waits on another (a collective, a point-to-point receive, a pipe write, a GPU sync behind an NCCL
kernel) shows nothing from outside: NCCL kernels never time out, and the driver's watchdog fails the engine only
after KVFLOW_TP_TIMEOUT_S. So every rank keeps a `HangWatch`: the task it is in (a step, a frame written to a rank)
and, when one runs past KVFLOW_TP_HANG_REPORT_S (default 30 s; 0: off), it logs once what the task is, how long
it has run, the communication calls this rank issued during it (`CallLog`: counts by kind and peer, and the last
one) and then every thread's Python stack (faulthandler's, buffered and written to stderr whole, so that ranks
reporting at once do not interleave mid-line). Read side by side, the ranks' reports
say who waits for whom. On GPUs the calls are issued asynchronously: a rank's count says what it enqueued, its
stack where its host waits (a stream sync behind the GPU's collective, a pipe write, an NCCL call setting up a
connection).
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import logging
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

REPORT_ENV = "KVFLOW_TP_HANG_REPORT_S"
DEFAULT_REPORT_S = 30.0


def hang_report_s() -> float:
    """KVFLOW_TP_HANG_REPORT_S: seconds a task runs before its rank reports it (0 turns the reports off)."""
    raw = os.environ.get(REPORT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_REPORT_S
    except ValueError as exc:
        raise ValueError(f"{REPORT_ENV} must be a number of seconds, got {raw!r}") from exc
    if value < 0:
        raise ValueError(f"{REPORT_ENV} must be >= 0, got {raw!r}")
    return value


def thread_stacks() -> bytes:
    """Every thread's stack (faulthandler's text), dumped into a buffer first: faulthandler writes a line in
    several pieces, and ranks that report at the same moment into one stderr would interleave mid-line."""
    with tempfile.TemporaryFile() as buffer:
        faulthandler.dump_traceback(file=buffer, all_threads=True)
        buffer.seek(0)
        return buffer.read()


def write_whole(fd: int, data: bytes) -> None:
    """`data` to `fd` in as few writes as the fd takes (one, for a file or a pipe under its buffer size)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class CallLog:
    """The communication calls one group issued: counts by (kind, peer) and the last one. Cheap (a counter
    increment per call); formatted only in a report."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int | None]] = Counter()
        self.last: tuple[str, int | None, tuple[int, ...], str] | None = None

    def record(self, kind: str, shape: tuple[int, ...], dtype: Any, peer: int | None = None) -> None:
        self.counts[(kind, peer)] += 1
        self.last = (kind, peer, shape, str(dtype).removeprefix("torch."))

    def snapshot(self) -> Counter[tuple[str, int | None]]:
        return Counter(self.counts)

    def since(self, before: Counter[tuple[str, int | None]]) -> str:
        """The calls issued since `before` and the last call, as one line."""
        delta = self.counts - before
        calls = ", ".join(f"{kind}{'' if peer is None else f' rank {peer}'} x{n}"
                          for (kind, peer), n in sorted(delta.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)))
        last = "none" if self.last is None else \
            f"{self.last[0]}{'' if self.last[1] is None else f' rank {self.last[1]}'} {list(self.last[2])} " \
            f"{self.last[3]}"
        return f"{calls or 'no calls'} (last ever: {last})"


class HangWatch:
    """Tasks in progress on this rank and a daemon thread that reports each one that runs past `report_s`.
    `describe()` adds the rank's own state (its groups' calls, frames waiting) to every report."""

    def __init__(self, who: str, report_s: float, describe: Callable[[], str] | None = None) -> None:
        self.who, self.report_s, self.describe = who, report_s, describe
        self._tasks: dict[int, tuple[str | Callable[[], str], float, Callable[[], str] | None]] = {}
        self._reported: set[int] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.reports = 0  # how many reports were written (tests)
        if report_s > 0:
            threading.Thread(target=self._watch, name="hang-watch", daemon=True).start()

    @contextlib.contextmanager
    def task(self, what: str | Callable[[], str], detail: Callable[[], str] | None = None) -> Iterator[None]:
        """The block is one task, named by `what` (a callable is called only for a report: a task per step must
        not format its name every step); `detail()` (also only for a report) says what it did so far."""
        if self.report_s <= 0:
            yield
            return
        key = next(self._ids)
        with self._lock:
            self._tasks[key] = (what, time.monotonic(), detail)
        try:
            yield
        finally:
            with self._lock:
                self._tasks.pop(key, None)
                self._reported.discard(key)

    def overdue(self, now: float) -> list[tuple[int, str, float, Callable[[], str] | None]]:
        """Tasks past `report_s` not reported yet (key, what, seconds, detail)."""
        with self._lock:
            late = [(key, what, now - started, detail) for key, (what, started, detail) in self._tasks.items()
                    if now - started > self.report_s and key not in self._reported]
        return [(key, what if isinstance(what, str) else what(), seconds, detail)
                for key, what, seconds, detail in late]

    def report_overdue(self, now: float | None = None) -> int:
        """Report every overdue task once; how many were reported."""
        late = self.overdue(time.monotonic() if now is None else now)
        reported = 0
        for key, what, seconds, detail in late:
            with self._lock:
                if key not in self._tasks:
                    # It ended while this thread was getting to it (a loaded host can starve the watch thread for
                    # seconds): nothing is stuck, and the stacks would show the rank after the task.
                    continue
                self._reported.add(key)
            parts = [f"{self.who}: {what} has run for {seconds:.0f} s (if it never ends, a rank waits for another)"]
            for extra in (detail, self.describe):
                if extra is not None:
                    with contextlib.suppress(Exception):  # a report must never take the rank down
                        parts.append(extra())
            logger.error("; ".join(parts) + "; every thread's stack follows")
            with contextlib.suppress(Exception):
                for handler in logging.getLogger().handlers:
                    handler.flush()
                write_whole(sys.stderr.fileno(), thread_stacks())
            self.reports += 1
            reported += 1
        return reported

    def _watch(self) -> None:
        interval = min(1.0, self.report_s / 4)
        while not self._stopped.wait(interval):
            self.report_overdue()

    def close(self) -> None:
        self._stopped.set()
