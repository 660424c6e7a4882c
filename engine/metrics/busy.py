"""The share of recent wall time an engine spent running steps (0 idle, 1 never idle): the router's pool planner
reads it to tell an underused pool from a saturated one."""

from __future__ import annotations

from collections import deque

BUSY_WINDOW_S = 2.0


class BusyMeter:
    """Step intervals of the last `window_s` seconds (the engine thread only)."""

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float]] = deque()  # (start, end), in order

    def record(self, start: float, end: float) -> None:
        self._steps.append((start, end))
        self._trim(end)

    def fraction(self, now: float) -> float:
        self._trim(now)
        since = now - self.window_s
        busy = sum(end - max(start, since) for start, end in self._steps)
        return min(max(busy / self.window_s, 0.0), 1.0)

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][1] < now - self.window_s:
            self._steps.popleft()
